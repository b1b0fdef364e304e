"""The Mamba language model on one device: embedding -> blocks -> final norm -> head.

State-dict keys and initialisation are mamba_ssm's `MambaLMHeadModel`; each piece draws from
its own seeded stream (`build_piece`), so a pipeline stage draws only its own. The same class
runs tensor- and context-parallel (`tp=`, `cp=`), and holds the pieces a stage needs
(`make_embedding`, `Block`, `make_norm`, `make_head`, `lm_loss`). Design: docs/code.md.
"""
import contextlib
import math
import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megamamba.block import Block, make_norm
from megamamba.config import MambaConfig
from megamamba.cross_entropy import chunked_cross_entropy
from megamamba.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    local_shard,
    parallel_linear,
    vocab_parallel_cross_entropy,
)
from megamamba.parallel.context_parallel import ContextParallel, mean_over_context
from megamamba.parallel.from_full import sharded
from megamamba.parallel.model_layout import check_model_layout, check_sequence_length

EMBEDDING_INIT_STD = 0.02
EMBEDDING, NORM_F, HEAD = "backbone.embedding.weight", "backbone.norm_f", "lm_head.weight"  # mamba_ssm's keys


def _split(tp: Optional[TensorParallel]) -> Optional[TensorParallel]:
    """`tp` when it splits anything, None for no TP or a single rank (the plain model)."""
    return tp if tp is not None and tp.size > 1 else None


def make_embedding(config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None) -> nn.Module:
    """Token ids (batch, seqlen) -> (batch, seqlen, d_model): nn.Embedding over the padded vocab, or
    under TP a VocabParallelEmbedding whose output is replicated, or with sequence parallelism this
    rank's sequence shard (batch, seqlen / TP, d_model)."""
    full = nn.Embedding(config.padded_vocab_size, config.d_model, device=device, dtype=dtype)
    if _split(tp) is None:
        return full
    return sharded(full, lambda: VocabParallelEmbedding(config.padded_vocab_size, config.d_model, tp), tp)


def make_head(config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None) -> nn.Module:
    """The untied head, hidden -> logits: nn.Linear to the padded vocab, or under TP a VocabParallelHead
    giving this rank's block of the logits (with sequence parallelism it gathers the hidden shards)."""
    full = nn.Linear(config.d_model, config.padded_vocab_size, bias=False, device=device, dtype=dtype)
    if _split(tp) is None:
        return full
    return sharded(full, lambda: VocabParallelHead(config.d_model, config.padded_vocab_size, tp), tp)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: Optional[TensorParallel] = None) -> torch.Tensor:
    """The tied head: hidden @ weight.T with the embedding's weight (under TP its local rows, giving
    this rank's block of the logits; with sequence parallelism the hidden shards are gathered)."""
    if _split(tp) is None:
        return F.linear(hidden, weight)
    return parallel_linear(hidden, weight, None, tp)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
            tp: Optional[TensorParallel] = None, cp: Optional[ContextParallel] = None) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose label is not -100, on the real vocabulary (padded
    columns excluded). Under TP `logits` is this rank's vocab block and the full logits are never
    gathered (`vocab_parallel_cross_entropy`); every rank gets the loss. On one device the float32
    logits are never materialized whole (`chunked_cross_entropy`). Under CP `logits` and `labels`
    are this rank's slice and the mean is over the whole sequences (`mean_over_context`)."""
    if _split(tp) is None:
        loss = chunked_cross_entropy(logits, labels, vocab_size)
    else:
        loss = vocab_parallel_cross_entropy(logits, labels, tp, vocab_size=vocab_size)
    return loss if cp is None or cp.size == 1 else mean_over_context(loss, labels, cp)


def draw_seed(device=None) -> int:
    """The one number a model's initialisation takes from the global random stream; none for a model
    built on the meta device (shapes only), so reading a config's shapes leaves the stream alone."""
    target = torch.device(device) if device is not None else torch.get_default_device()
    if target.type == "meta":
        return 0
    return int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))


@contextlib.contextmanager
def _piece_stream(seed: int, piece: int, device):
    """The random stream of one piece: the CPU's (and the build device's, on CUDA) generator, seeded from
    (seed, piece); the global streams are left as they were."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        piece_seed = (seed * 1_000_003 + piece) % 2**63
        torch.random.default_generator.manual_seed(piece_seed)
        if cuda:
            torch.cuda.manual_seed(piece_seed)
        yield


def _redraw(param: nn.Parameter, full_shape: tuple, draw, tp: Optional[TensorParallel]) -> None:
    """Re-initialise `param` with `draw`, applied under TP to the full tensor, then sliced."""
    if tp is None:
        draw(param)
        return
    full = draw(torch.empty(full_shape, device=param.device, dtype=param.dtype))
    param.copy_(local_shard(full, param.tp_shard, tp.size, tp.rank))


@torch.no_grad()
def _zero_biases(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
            for bias in (m.bias, getattr(m, "bias_replicated", None)):
                if bias is not None and not getattr(bias, "_no_reinit", False):
                    nn.init.zeros_(bias)


@torch.no_grad()
def build_piece(config: MambaConfig, piece: int, seed: int, device=None, dtype=None,
                tp: Optional[TensorParallel] = None, cp: Optional[ContextParallel] = None) -> nn.Module:
    """Piece `piece` of the model initialised from `seed`: 0 the embedding, i + 1 block i, n_layer + 1 the
    final norm, n_layer + 2 the untied head (under `tp` this rank's shards of the same values; a block
    built with `cp` works on a slice of the sequence, with the same values)."""
    n = config.n_layer
    tp = _split(tp)
    with _piece_stream(seed, piece, device):
        if piece == 0:
            module = make_embedding(config, device=device, dtype=dtype, tp=tp)
            _redraw(module.weight, (config.padded_vocab_size, config.d_model),
                    lambda w: nn.init.normal_(w, std=EMBEDDING_INIT_STD), tp)
        elif piece <= n:
            module = Block(config, device=device, dtype=dtype, tp=tp, cp=cp)
            _zero_biases(module)
            _redraw(module.mixer.out_proj.weight, (config.d_model, config.d_inner),
                    lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)).div_(math.sqrt(n)), tp)
        elif piece == n + 1:
            module = make_norm(config, device=device, dtype=dtype, tp=tp)
        elif piece == n + 2 and not config.tie_embeddings:
            module = make_head(config, device=device, dtype=dtype, tp=tp)
        else:
            raise ValueError(f"piece {piece}: a {n}-layer model (tie_embeddings={config.tie_embeddings}) has pieces "
                             f"0 .. {n + 1 if config.tie_embeddings else n + 2}")
    return module


def piece_of(name: str, config: MambaConfig) -> int:
    """The piece (`build_piece`) holding the mamba_ssm-named parameter `name`."""
    if name == EMBEDDING or (name == HEAD and config.tie_embeddings):
        return 0
    if name == HEAD:
        return config.n_layer + 2
    if name.startswith(NORM_F + "."):
        return config.n_layer + 1
    m = re.fullmatch(r"backbone\.layers\.(\d+)\..+", name)
    if m is None or int(m.group(1)) >= config.n_layer:
        raise KeyError(f"{name!r} is not a parameter of a mamba_ssm {config.n_layer}-layer model")
    return int(m.group(1)) + 1


def initial_piece(config: MambaConfig, piece: int, seed: int) -> dict:
    """The full single-device tensors of one piece, under mamba_ssm's names, as `MambaLM` built from
    `seed` holds them."""
    module = build_piece(config, piece, seed)
    n = config.n_layer
    ends = {0: "backbone.embedding.", n + 1: NORM_F + ".", n + 2: "lm_head."}
    prefix = ends.get(piece, f"backbone.layers.{piece - 1}.")
    state = {prefix + k: v for k, v in module.state_dict().items()}
    if piece == 0 and config.tie_embeddings:
        state[HEAD] = state[EMBEDDING]
    return state


class MambaBackbone(nn.Module):
    """Token ids -> final-normed hidden states (batch, seqlen, d_model)."""

    def __init__(self, config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None,
                 seed: Optional[int] = None, cp: Optional[ContextParallel] = None):
        super().__init__()
        seed = draw_seed(device) if seed is None else seed
        self.embedding = build_piece(config, 0, seed, device, dtype, tp)
        self.layers = nn.ModuleList(build_piece(config, i + 1, seed, device, dtype, tp, cp)
                                    for i in range(config.n_layer))
        self.norm_f = build_piece(config, config.n_layer + 1, seed, device, dtype, tp)

    def _final_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        residual = hidden_states + residual
        return self.norm_f(residual.to(dtype=self.norm_f.weight.dtype))

    def forward(self, input_ids: torch.Tensor, seq_idx: Optional[torch.Tensor] = None,
                inference_cache: Optional[list] = None) -> torch.Tensor:
        hidden_states, residual = self.embedding(input_ids), None
        for i, layer in enumerate(self.layers):
            state = None if inference_cache is None else inference_cache[i]
            hidden_states, residual = layer(hidden_states, residual, seq_idx=seq_idx, inference_state=state)
        return self._final_norm(hidden_states, residual)

    def step(self, input_ids: torch.Tensor, inference_cache: list) -> torch.Tensor:
        hidden_states, residual = self.embedding(input_ids), None
        for layer, state in zip(self.layers, inference_cache):
            hidden_states, residual = layer.step(hidden_states, residual, state)
        return self._final_norm(hidden_states, residual)


class MambaLM(nn.Module):
    """Mamba-1 / Mamba-2 language model: `MambaLM(config)(input_ids)` -> logits (batch, seqlen, padded vocab).

    With `tp` (size > 1) the model is split across its tensor-parallel group (module docstring).
    With `cp` (size > 1) each rank of the context-parallel group runs a slice of every sequence.
    """

    def __init__(self, config: MambaConfig, device=None, dtype=None, tp: Optional[TensorParallel] = None,
                 cp: Optional[ContextParallel] = None):
        super().__init__()
        config.validate()
        self.tp = _split(tp)
        self.cp = cp if cp is not None and cp.size > 1 else None
        if self.tp is not None:
            check_model_layout(config, self.tp.size)
        self.config = config
        seed = draw_seed(device)
        self.backbone = MambaBackbone(config, device=device, dtype=dtype, tp=self.tp, seed=seed, cp=self.cp)
        if config.tie_embeddings:
            with _piece_stream(seed, config.n_layer + 2, device):  # its draw is replaced by the embedding
                self.lm_head = make_head(config, device=device, dtype=dtype, tp=self.tp)
            self.lm_head.weight = self.backbone.embedding.weight
        else:
            self.lm_head = build_piece(config, config.n_layer + 2, seed, device, dtype, self.tp)

    def forward(self, input_ids: torch.Tensor, seq_idx: Optional[torch.Tensor] = None,
                inference_cache: Optional[list] = None) -> torch.Tensor:
        """input_ids (batch, seqlen) -> logits (batch, seqlen, padded_vocab_size).

        seq_idx (batch, seqlen) int32 document ids: the state of every layer resets where the id
        changes, so packed documents do not see each other. inference_cache (from
        allocate_inference_cache): filled with the states after the last position, so `step`
        continues the sequence (prefill); not combined with seq_idx.

        Under CP: input_ids and seq_idx are this rank's slice (batch, seqlen / C), the ids of a document
        the same on every rank; the logits are the slice's. No inference_cache.

        Under TP: input_ids and seq_idx whole and the same on every rank; the logits are LOCAL,
        this rank's vocab block (batch, seqlen, rows) of the TP-padded vocab, rank r holding
        columns [r * rows, (r + 1) * rows). Use `loss`, or `lm_loss` / `vocab_parallel_cross_entropy`
        on them; `gather_from_tp_region(logits, tp)[..., :padded_vocab_size]` gives the full ones.
        """
        if seq_idx is not None and seq_idx.shape != input_ids.shape:
            raise ValueError(f"seq_idx shape {tuple(seq_idx.shape)} must equal input_ids shape "
                             f"{tuple(input_ids.shape)}")
        if seq_idx is not None and inference_cache is not None:
            raise ValueError("inference_cache with seq_idx: a prefill continues one sequence; "
                             "pass packed documents without a cache")
        if self.tp is not None:
            check_sequence_length(input_ids.shape[1], self.tp.size, self.tp.sequence_parallel)
            if inference_cache is not None:
                self._check_recurrent_form()
        return self.lm_head(self.backbone(input_ids, seq_idx=seq_idx, inference_cache=inference_cache))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
             seq_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean cross-entropy of `labels` (batch, seqlen; -100 = ignored) under the logits of `input_ids`,
        over the real vocabulary; under TP computed on the vocab-parallel logits, never gathered."""
        return lm_loss(self(input_ids, seq_idx=seq_idx), labels, self.config.vocab_size, self.tp, self.cp)

    def _check_recurrent_form(self) -> None:
        if self.tp is not None and self.tp.sequence_parallel:
            raise ValueError("the recurrent form (inference_cache, step) is not sequence-parallel: "
                             "build the model with tp.without_sequence_parallel() for generation")

    def allocate_inference_cache(self, batch_size: int, dtype=None) -> list:
        """Zeroed recurrent state for `step`: one (conv_state, ssm_state) per layer."""
        return [layer.mixer.allocate_inference_cache(batch_size, dtype=dtype) for layer in self.backbone.layers]

    def step(self, input_ids: torch.Tensor, inference_cache: list) -> torch.Tensor:
        """One token per sequence: input_ids (batch,) -> logits (batch, padded_vocab_size); the cache
        advances in place."""
        self._check_recurrent_form()
        return self.lm_head(self.backbone.step(input_ids, inference_cache))
