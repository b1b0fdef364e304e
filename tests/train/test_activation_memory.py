"""The activation estimate follows the shapes: more tokens or more micro-batches in flight keep more,
recomputation, tensor and sequence parallelism keep less. (How close it comes to a measured peak is
a GPU check: mamba2-130m and 1.3b within 20% of torch.cuda.max_memory_allocated.)"""
import pytest

from train_entry import ROOT

from megamamba.config import MambaConfig
from megamamba.pipelines.activation_memory import ActivationShape, stage_activation_bytes

MODELS = ["mamba1-130m", "mamba2-130m", "mamba2-1.3b"]


def _model(name: str) -> MambaConfig:
    return MambaConfig.from_json(str(ROOT / "launch/models" / f"{name}.json"))


def _whole_model(shape: ActivationShape) -> int:
    """The estimate for a one-stage run: layers [0, n_layer + 3)."""
    last = shape.model.n_layer + 2
    return stage_activation_bytes(shape, 0, last + 1, last)


def _shape(name: str, **changes) -> ActivationShape:
    settings = dict(model=_model(name), micro_batch_size=4, seq_length=2048, autocast=True)
    return ActivationShape(**{**settings, **changes})


@pytest.mark.parametrize("name", MODELS)
def test_more_tokens_keep_more(name):
    base = _whole_model(_shape(name))
    assert _whole_model(_shape(name, micro_batch_size=8)) > base
    assert _whole_model(_shape(name, seq_length=4096)) > base


@pytest.mark.parametrize("name", MODELS)
def test_twice_the_tokens_keep_more_but_at_most_twice_as_much(name):
    """Activations are linear in the tokens, plus fixed parts (weight copies, the loss's chunk)."""
    one, two = _whole_model(_shape(name, micro_batch_size=4)), _whole_model(_shape(name, micro_batch_size=8))
    assert one < two <= 2 * one


@pytest.mark.parametrize("name", MODELS)
def test_recomputation_keeps_less(name):
    none = _whole_model(_shape(name))
    for interval in (1, 2, 4):
        assert _whole_model(_shape(name, checkpoint_interval=interval)) < none, interval


@pytest.mark.parametrize("name", MODELS)
def test_tensor_and_sequence_parallelism_keep_less_per_rank(name):
    alone = _whole_model(_shape(name))
    tp2 = _whole_model(_shape(name, tp=2))
    assert tp2 < alone
    assert _whole_model(_shape(name, tp=2, sequence_parallel=True)) < tp2


@pytest.mark.parametrize("name", MODELS)
def test_each_micro_batch_in_flight_adds_the_same(name):
    one, two, three = (_whole_model(_shape(name, in_flight=k)) for k in (1, 2, 3))
    assert one < two < three and three - two == two - one


@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast_keeps_less_than_float32(name):
    assert _whole_model(_shape(name)) < _whole_model(_shape(name, autocast=False))

