"""Export streams tensor by tensor and shards above --max-shard-size as transformers does (safetensors_stream.py).

Memory is measured by counting the bytes of the tensors the export holds (each loaded tensor is
tracked until it is freed), not by RSS, which the allocator and page cache blur.
"""

import json
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from checkpoint_fixtures import assert_equal_but_the_vocabulary_padding, perturbed_model, tiny
from megamamba.checkpoint import model_tensors, save_checkpoint
from megamamba.checkpoint.convert import main
from megamamba.checkpoint.model_folder import load_model_folder
from megamamba.checkpoint.safetensors_stream import TensorReader, TensorSpec, parse_size, plan_shards, write_sharded
from megamamba.testing.numerics import relative_error

LIMIT = 2000  # bytes: the tiny models' embedding (40 x 18 float32 = 2880 B) is above it, the rest well below


def export(tmp_path, layer: str = "Mamba2", *flags, **fields):
    config = tiny(layer, **fields)
    model = perturbed_model(config, 4)
    save_checkpoint(str(tmp_path / "ckpt"), 2, config, model_tensors(model))
    main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), *flags])
    return model, tmp_path / "hf"


@pytest.mark.parametrize(
    "text,size",
    [("5GB", 5 * 10**9), ("4GiB", 4 * 2**30), ("500MB", 5 * 10**8), ("1000", 1000), ("2 kib", 2048), ("1.5KB", 1500)],
)
def test_sizes_read_as_transformers_writes_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "5XB", "GB", "-1MB", ""])
def test_a_size_without_a_known_unit_or_below_a_byte_is_refused(text):
    with pytest.raises(ValueError, match="expected a positive byte count or a number with a unit"):
        parse_size(text)


def test_shards_fill_in_order_and_a_tensor_above_the_limit_is_alone():
    specs = [TensorSpec(n, "F32", (s,)) for n, s in [("a", 100), ("b", 150), ("c", 600), ("d", 10), ("e", 240)]]
    shards = plan_shards(specs, 1000)
    assert [[s.name for s in shard] for shard in shards] == [["a", "b"], ["c"], ["d", "e"]]


def test_mixed_dtypes_read_back_bit_identical_and_aligned(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "odd_bf16": torch.randn(3, generator=gen).bfloat16(),
        "f64": torch.randn(2, 5, generator=gen).double(),
        "i8": torch.randint(-100, 100, (7,), generator=gen, dtype=torch.int8),
        "scalar": torch.tensor(1.5),
        "f32": torch.randn(4, 3, generator=gen),
        "flags": torch.tensor([True, False, True]),
    }
    dtypes = {torch.bfloat16: "BF16", torch.float64: "F64", torch.int8: "I8", torch.float32: "F32", torch.bool: "BOOL"}
    specs = [TensorSpec(n, dtypes[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    files = write_sharded(str(tmp_path), specs, tensors.__getitem__, "100B")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files == sorted(set(index["weight_map"].values())) + ["model.safetensors.index.json"]
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
    back = {}
    for file in files[:-1]:
        back.update(load_file(str(tmp_path / file)))
        with open(tmp_path / file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        assert header_len % 8 == 0
        with safe_open(str(tmp_path / file), "pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert back.keys() == tensors.keys() and all(torch.equal(back[n], t) for n, t in tensors.items())


def test_a_small_model_exports_as_one_file(tmp_path):
    _, hf = export(tmp_path)
    assert sorted(p.name for p in hf.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_above_the_limit_the_export_is_sharded_with_an_index_and_imports_bit_identical_but_the_padding(tmp_path):
    model, hf = export(tmp_path, "Mamba2", "--max-shard-size", str(LIMIT), tie_embeddings=False)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    for shard in shards:
        with safe_open(str(hf / shard), "pt") as f:
            sizes = [f.get_slice(n).get_shape() for n in f.keys()]
        total = sum(torch.Size(s).numel() * 4 for s in sizes)
        assert total <= LIMIT or len(sizes) == 1, (shard, total)
    assert "backbone.embeddings.weight" in index["weight_map"] and "lm_head.weight" in index["weight_map"]
    main(["import", "--from", "hf", "--input", str(hf), "--output", str(tmp_path / "ours")])
    back = load_model_folder(str(tmp_path / "ours"))
    assert_equal_but_the_vocabulary_padding(back.state_dict(), model.state_dict(), model.config)


class HeldBytes:
    """Bytes of the tensors loaded and not yet freed: now and at the peak."""

    def __init__(self):
        self.now = self.peak = 0
        self.loaded = []

    def track(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.now += size
        self.peak = max(self.peak, self.now)
        self.loaded.append((name, size))
        weakref.finalize(tensor, self._free, size)
        return tensor

    def _free(self, size: int) -> None:
        self.now -= size


def test_the_export_holds_one_tensor_at_a_time_never_a_shard(tmp_path, monkeypatch):
    held, load = HeldBytes(), TensorReader.load
    monkeypatch.setattr(TensorReader, "load", lambda self, name: held.track(name, load(self, name)))
    model, hf = export(tmp_path, "Mamba1", "--max-shard-size", "20KB", tie_embeddings=False)
    assert len(set(json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"].values())) == 2
    sizes = {n: p.numel() * p.element_size() for n, p in model.state_dict().items()}
    assert sorted(n for n, _ in held.loaded) == sorted(sizes), "every tensor is read once, through the reader"
    largest, shard_bound = max(sizes.values()), parse_size("20KB") + max(sizes.values())
    print(
        f"peak held {held.peak} B; largest tensor {largest} B; one shard plus one tensor {shard_bound} B; "
        f"model {sum(sizes.values())} B"
    )
    assert held.peak == largest < shard_bound and held.now == 0


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_transformers_loads_the_sharded_export_with_our_logits(tmp_path, monkeypatch, layer):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    model, hf = export(tmp_path, layer, "--max-shard-size", str(LIMIT), tie_embeddings=layer == "Mamba1")
    assert (hf / "model.safetensors.index.json").is_file()
    cls = transformers.MambaForCausalLM if layer == "Mamba1" else transformers.Mamba2ForCausalLM
    theirs, info = cls.from_pretrained(str(hf), output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model.double()(ids)[..., : model.config.vocab_size]  # the export holds the real vocabulary's rows
        out = theirs.eval()(ids).logits.double()
    assert torch.isfinite(out).all()
    err = relative_error(out, ref)
    assert err <= 1e-4, (layer, err, "seed 5")
