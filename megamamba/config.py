"""Model configuration in mamba_ssm's config.json form.

`MambaConfig` has mamba_ssm's fields and defaults, so its config.json loads unchanged; options that
only pick mamba_ssm's fused kernels are accepted, options we do not implement are refused by name.
Two fields of our own describe hybrids the Megatron way (`hybrid_layer_pattern`, `mlp_activation`);
at their defaults they are left out of config.json. More: docs/code.md ("The model in code").
"""

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from megamamba.errors import MegamambaError

MIXER_LAYERS = ("Mamba1", "Mamba2", "Mamba3")
A_ACTIVATIONS = ("heavy_tail", "softplus")  # Mamba-3's f in A = -f(dd_A): mamba_ssm main, 2.3.2.post1 and earlier
MLP_ACTIVATIONS = ("gated_silu", "squared_relu")  # mamba_ssm's GatedMLP; Nemotron-H's relu(x)^2
# hybrid_layer_pattern's letters (Megatron's; "|" ends a pipeline stage), each the kind of block that registers
# it (`megamamba.model.layer_types.register`). mamba_ssm's fields place the first three: attn_layer_idx's
# attention among Mamba blocks, and d_intermediate the width of the MLP blocks.
MAMBA_LETTER, ATTENTION_LETTER, MLP_LETTER = "M", "*", "-"
PATTERN_SYMBOLS: dict[str, str] = {}
# ssm_cfg.layer -> the kind its M blocks are, where that is not the M letter's own (`register(..., mixer=)`)
MIXER_KINDS: dict[str, str] = {}
GATED_MLP_MULTIPLE = 128  # mamba_ssm's GatedMLP rounds its hidden width up to a multiple of this


@dataclass(frozen=True)
class Mamba1Options:
    """mamba_ssm's `Mamba` (mamba_simple.py) constructor options and defaults."""

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: Union[int, str] = "auto"
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init: str = "random"
    dt_scale: float = 1.0
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    bias: bool = False
    use_fast_path: bool = True


@dataclass(frozen=True)
class Mamba2Options:
    """mamba_ssm's `Mamba2` (mamba2.py) constructor options and defaults."""

    d_state: int = 128
    d_conv: int = 4
    conv_init: Optional[float] = None
    expand: int = 2
    headdim: int = 64
    d_ssm: Optional[int] = None
    ngroups: int = 1
    A_init_range: tuple = (1, 16)
    D_has_hdim: bool = False
    rmsnorm: bool = True
    norm_before_gate: bool = False
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple = (0.0, float("inf"))
    bias: bool = False
    conv_bias: bool = True
    chunk_size: int = 256
    use_mem_eff_path: bool = True


@dataclass(frozen=True)
class Mamba3Options:
    """mamba_ssm's `Mamba3` (modules/mamba3.py) constructor options and defaults, and `a_activation`, which
    no checkpoint records: "heavy_tail" (mamba_ssm main since its PR #962) or "softplus" (2.3.2.post1)."""

    d_state: int = 128
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    rope_fraction: float = 0.5
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_floor: float = 1e-4
    is_outproj_norm: bool = False
    is_mimo: bool = False
    mimo_rank: int = 4
    chunk_size: int = 64
    a_activation: str = "heavy_tail"

    @property
    def rank(self) -> int:
        """The MIMO rank R (1 for SISO)."""
        return self.mimo_rank if self.is_mimo else 1

    @property
    def num_rope_angles(self) -> int:
        """Angles per head: d_state * rope_fraction rounded down to even, halved (mamba_ssm's)."""
        rotated = int(self.d_state * self.rope_fraction)
        return (rotated - rotated % 2) // 2


MixerOptions = Union[Mamba1Options, Mamba2Options, Mamba3Options]
OPTIONS_OF_LAYER = {"Mamba1": Mamba1Options, "Mamba2": Mamba2Options, "Mamba3": Mamba3Options}


@dataclass(frozen=True)
class AttentionOptions:
    """mamba_ssm's `MHA` (modules/mha.py) constructor options (attn_cfg) and defaults; num_heads is required."""

    num_heads: int
    num_heads_kv: Optional[int] = None
    head_dim: Optional[int] = None
    mlp_dim: int = 0
    qkv_proj_bias: bool = True
    out_proj_bias: bool = True
    softmax_scale: Optional[float] = None
    causal: bool = False
    d_conv: int = 0
    rotary_emb_dim: int = 0
    rotary_emb_base: float = 10000.0
    rotary_emb_interleaved: bool = False

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_heads_kv is None else self.num_heads_kv

    def head_dim_for(self, d_model: int) -> int:
        """An attention head's width: head_dim, or d_model / num_heads as mamba_ssm's MHA."""
        return self.head_dim if self.head_dim is not None else d_model // self.num_heads


class ConfigError(MegamambaError, ValueError):
    """A config field has a value the model cannot build; the message names the field."""


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r}: must be a positive integer")


def _boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: must be true or false")


def _positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r}: must be a positive number")


def _pair(name: str, value: Any) -> None:
    numbers = isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    )
    if not numbers or len(value) != 2:
        raise ConfigError(f"{name}={value!r}: must be a pair of numbers [low, high]")


MOE_LETTER = "E"  # a mixture-of-experts block, configured by moe_cfg
MOE_ACTIVATIONS = ("relu2", "gated_silu")  # Nemotron-H's relu(x)^2; Granite's and Mixtral's y * silu(gate)
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss")  # Megatron's: over the micro-batch, or per sequence


@dataclass(frozen=True)
class MoEOptions:
    """A mixture-of-experts block's options (moe_cfg): NemotronH's routing (transformers) with Megatron's
    load-balancing losses; num_experts, top_k and ffn_hidden_size (per routed expert) are required."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    activation: str = "gated_silu"
    score_function: str = "softmax"
    expert_bias: bool = False  # a score-correction bias for selection only, updated from the load
    bias_update_rate: float = 1e-3
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    aux_loss_coeff: float = 0.0
    aux_loss_type: str = "aux_loss"
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None  # None: dropless

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group


def _non_negative_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name}={value!r}: must be a number >= 0")


def validate_moe_cfg(moe_cfg: Any) -> None:
    """Raise ConfigError naming the first moe_cfg option whose value an MoE block cannot build."""
    if not isinstance(moe_cfg, dict):
        raise ConfigError(f"moe_cfg={moe_cfg!r}: must be a dict of mixture-of-experts options")
    known = [f.name for f in dataclasses.fields(MoEOptions)]
    for key in moe_cfg:
        if key not in known:
            raise ConfigError(f"moe_cfg.{key}={moe_cfg[key]!r} is not a mixture-of-experts option; known: {known}")
    for key in ("num_experts", "top_k", "ffn_hidden_size"):
        if key not in moe_cfg:
            raise ConfigError(f"moe_cfg has no {key}: an MoE block needs num_experts, top_k and ffn_hidden_size")
    o = MoEOptions(**moe_cfg)
    for name in ("num_experts", "top_k", "ffn_hidden_size", "n_group", "topk_group"):
        _positive_int(f"moe_cfg.{name}", getattr(o, name))
    shared = o.shared_expert_ffn_hidden_size
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"moe_cfg.shared_expert_ffn_hidden_size={shared!r}: must be an integer >= 0 (0: none)")
    if o.activation not in MOE_ACTIVATIONS:
        raise ConfigError(f"moe_cfg.activation={o.activation!r}: choose one of {MOE_ACTIVATIONS}")
    if o.score_function not in MOE_SCORE_FUNCTIONS:
        raise ConfigError(f"moe_cfg.score_function={o.score_function!r}: choose one of {MOE_SCORE_FUNCTIONS}")
    if o.aux_loss_type not in MOE_AUX_LOSS_TYPES:
        raise ConfigError(f"moe_cfg.aux_loss_type={o.aux_loss_type!r}: choose one of {MOE_AUX_LOSS_TYPES}")
    for name in ("expert_bias", "norm_topk_prob"):
        _boolean(f"moe_cfg.{name}", getattr(o, name))
    for name in ("bias_update_rate", "aux_loss_coeff", "z_loss_coeff"):
        _non_negative_number(f"moe_cfg.{name}", getattr(o, name))
    _positive_number("moe_cfg.routed_scaling_factor", o.routed_scaling_factor)
    if o.capacity_factor is not None:
        _positive_number("moe_cfg.capacity_factor", o.capacity_factor)
    if o.top_k > o.num_experts:
        raise ConfigError(f"moe_cfg.top_k={o.top_k}: more than num_experts={o.num_experts}")
    if o.num_experts % o.n_group:
        raise ConfigError(f"moe_cfg.n_group={o.n_group}: num_experts={o.num_experts} is not divisible by it")
    if o.topk_group > o.n_group:
        raise ConfigError(f"moe_cfg.topk_group={o.topk_group}: more than n_group={o.n_group}")
    if o.n_group > 1 and o.experts_per_group < 2:
        raise ConfigError(
            f"moe_cfg.n_group={o.n_group}: groups of {o.experts_per_group} expert; a group is scored by its "
            "two best experts, so it needs at least 2 (use fewer groups)"
        )
    if o.top_k > o.topk_group * o.experts_per_group:
        raise ConfigError(
            f"moe_cfg.top_k={o.top_k}: more than the {o.topk_group * o.experts_per_group} experts of the "
            f"topk_group={o.topk_group} groups a token may use; raise topk_group"
        )


OWN_FIELDS = {"hybrid_layer_pattern": "", "mlp_activation": "gated_silu", "moe_cfg": {}}  # not mamba_ssm's: defaults


@dataclass
class MambaConfig:
    """A Mamba language model: mamba_ssm's config fields, names and defaults."""

    d_model: int = 2560
    d_intermediate: int = 0
    n_layer: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict = field(default_factory=dict)
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    hybrid_layer_pattern: str = ""
    mlp_activation: str = "gated_silu"
    moe_cfg: dict = field(default_factory=dict)

    def __post_init__(self):
        # Own copies in JSON's shapes (tuples as lists), so a config equals its config.json reload.
        if isinstance(self.ssm_cfg, dict):
            self.ssm_cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in self.ssm_cfg.items()}
        if isinstance(self.attn_layer_idx, tuple):
            self.attn_layer_idx = list(self.attn_layer_idx)
        self.validate()

    # ---- derived sizes -------------------------------------------------------------
    @property
    def layer(self) -> str:
        """The mixer: "Mamba1", "Mamba2" or "Mamba3"."""
        return self.ssm_cfg.get("layer", "Mamba1")

    @property
    def mixer_options(self) -> MixerOptions:
        """The mixer's options with mamba_ssm's defaults filled in."""
        opts = {k: v for k, v in self.ssm_cfg.items() if k != "layer"}
        cls = OPTIONS_OF_LAYER[self.layer]
        for key in ("A_init_range", "dt_limit"):
            if key in opts:
                opts[key] = tuple(float(v) for v in opts[key])
        return cls(**opts)

    @property
    def attention_options(self) -> AttentionOptions:
        """attn_cfg with mamba_ssm's MHA defaults filled in (the attention layers' options)."""
        return AttentionOptions(**self.attn_cfg)

    def head_dim_of(self, options: AttentionOptions) -> int:
        """An attention head's width at this d_model (`AttentionOptions.head_dim_for`)."""
        return options.head_dim_for(self.d_model)

    @property
    def layer_pattern(self) -> str:
        """One letter per block: hybrid_layer_pattern without its | marks, or mamba_ssm's attn_layer_idx written
        as attention letters among Mamba ones."""
        if self.hybrid_layer_pattern:
            return self.hybrid_layer_pattern.replace("|", "")
        attention = set(self.attn_layer_idx)
        return "".join(ATTENTION_LETTER if i in attention else MAMBA_LETTER for i in range(self.n_layer))

    @property
    def block_kinds(self) -> list:
        """What each of the n_layer blocks is: the kind its letter names ("mamba", "attention", "mlp", ...); M
        blocks are the kind registered for ssm_cfg.layer where there is one ("mamba3")."""
        mamba = MIXER_KINDS.get(self.layer, PATTERN_SYMBOLS.get(MAMBA_LETTER))
        return [mamba if s == MAMBA_LETTER else PATTERN_SYMBOLS[s] for s in self.layer_pattern]

    @property
    def pattern_stages(self) -> list:
        """With "|" in the pattern: the block count of each pipeline stage it marks; else []."""
        if "|" not in self.hybrid_layer_pattern:
            return []
        return [len(part) for part in self.hybrid_layer_pattern.split("|")]

    @property
    def mlp_inside_blocks(self) -> bool:
        """mamba_ssm's d_intermediate > 0: every block ends with norm2 + mlp (not with a pattern)."""
        return self.d_intermediate > 0 and not self.hybrid_layer_pattern

    @property
    def has_moe_layers(self) -> bool:
        """Whether any block is a mixture of experts (E)."""
        return MOE_LETTER in self.layer_pattern

    @property
    def moe_options(self) -> MoEOptions:
        """The mixture-of-experts blocks' options (moe_cfg) with their defaults filled in."""
        return MoEOptions(**self.moe_cfg)

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: d_intermediate, rounded up as mamba_ssm's GatedMLP inside blocks."""
        if self.mlp_inside_blocks and self.mlp_activation == "gated_silu":
            return -(-self.d_intermediate // GATED_MLP_MULTIPLE) * GATED_MLP_MULTIPLE
        return self.d_intermediate

    @property
    def d_inner(self) -> int:
        """Width of the mixer's inner (expanded) stream: expand * d_model."""
        return int(self.mixer_options.expand * self.d_model)

    @property
    def nheads(self) -> int:
        """Mamba-2 and Mamba-3 SSM heads: d_inner / headdim."""
        opts = self.mixer_options
        if isinstance(opts, Mamba1Options):
            raise AttributeError(f"nheads is a Mamba2 or Mamba3 size; this config's layer is {self.layer!r}")
        return self.d_inner // opts.headdim

    @property
    def dt_rank(self) -> int:
        """Mamba-1 rank of the dt projection, "auto" resolved to ceil(d_model / 16)."""
        opts = self.mixer_options
        if not isinstance(opts, Mamba1Options):
            raise AttributeError(f"dt_rank is a Mamba1 size; this config's layer is {self.layer!r}")
        return math.ceil(self.d_model / 16) if opts.dt_rank == "auto" else opts.dt_rank

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of pad_vocab_size_multiple, as mamba_ssm does."""
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m

    # ---- validation ----------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first field whose value the model cannot build."""
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple"):
            _positive_int(name, getattr(self, name))
        for name in ("rms_norm", "residual_in_fp32", "fused_add_norm", "tie_embeddings"):
            _boolean(name, getattr(self, name))
        self._validate_hybrid()
        if not isinstance(self.ssm_cfg, dict):
            raise ConfigError(f"ssm_cfg={self.ssm_cfg!r}: must be a dict of mixer options")
        if self.layer not in MIXER_LAYERS:
            raise ConfigError(f"ssm_cfg.layer={self.layer!r} is unknown; choose one of {MIXER_LAYERS}")
        cls = OPTIONS_OF_LAYER[self.layer]
        known = {f.name for f in dataclasses.fields(cls)}
        for key in self.ssm_cfg:
            if key != "layer" and key not in known:
                raise ConfigError(
                    f"ssm_cfg.{key}={self.ssm_cfg[key]!r} is not an option of {self.layer}; known: {sorted(known)}"
                )
        for key in ("A_init_range", "dt_limit"):
            if key in self.ssm_cfg:
                _pair(f"ssm_cfg.{key}", self.ssm_cfg[key])
        opts = self.mixer_options
        if isinstance(opts, Mamba3Options):
            self._validate_mamba3(opts)
            return
        self._validate_common(opts)
        if isinstance(opts, Mamba1Options):
            self._validate_mamba1(opts)
        else:
            self._validate_mamba2(opts)

    def _validate_hybrid(self) -> None:
        """The layer layout: mamba_ssm's attn_layer_idx / d_intermediate, or a Megatron-style pattern."""
        if isinstance(self.d_intermediate, bool) or not isinstance(self.d_intermediate, int) or self.d_intermediate < 0:
            raise ConfigError(f"d_intermediate={self.d_intermediate!r}: must be an integer >= 0 (0: no MLP)")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ConfigError(f"mlp_activation={self.mlp_activation!r}: choose one of {MLP_ACTIVATIONS}")
        if not isinstance(self.attn_layer_idx, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.attn_layer_idx
        ):
            raise ConfigError(f"attn_layer_idx={self.attn_layer_idx!r}: must be a list of layer numbers")
        if not isinstance(self.attn_cfg, dict):
            raise ConfigError(f"attn_cfg={self.attn_cfg!r}: must be a dict of attention options")
        if not isinstance(self.hybrid_layer_pattern, str):
            raise ConfigError(
                f"hybrid_layer_pattern={self.hybrid_layer_pattern!r}: must be a string such as "
                '"M-M*-" (M Mamba, * attention, - MLP, | a pipeline-stage boundary)'
            )
        if self.hybrid_layer_pattern:
            self._validate_pattern()
        self._validate_moe()
        outside = sorted(i for i in self.attn_layer_idx if not 0 <= i < self.n_layer)
        if outside:
            raise ConfigError(
                f"attn_layer_idx={self.attn_layer_idx!r}: {outside} outside the layers "
                f"0 .. {self.n_layer - 1} of n_layer={self.n_layer}"
            )
        if len(set(self.attn_layer_idx)) != len(self.attn_layer_idx):
            raise ConfigError(f"attn_layer_idx={self.attn_layer_idx!r}: names a layer twice")
        if ATTENTION_LETTER in self.layer_pattern:
            self._validate_attention()
        elif self.attn_cfg:
            raise ConfigError(
                f"attn_cfg={self.attn_cfg!r} with no attention layer: add layers to attn_layer_idx "
                "(or * to hybrid_layer_pattern / --hybrid-layer-pattern), or remove attn_cfg"
            )

    def _validate_moe(self) -> None:
        moe_layers = self.has_moe_layers
        if moe_layers and not self.moe_cfg:
            raise ConfigError(
                f"hybrid_layer_pattern={self.hybrid_layer_pattern!r} has mixture-of-experts layers (E) but no "
                "moe_cfg: give moe_cfg with num_experts, top_k and ffn_hidden_size"
            )
        if self.moe_cfg and not moe_layers:
            raise ConfigError(
                f"moe_cfg={self.moe_cfg!r} with no mixture-of-experts layer: add E to hybrid_layer_pattern, or "
                "remove moe_cfg"
            )
        if self.moe_cfg:
            validate_moe_cfg(self.moe_cfg)

    def _validate_pattern(self) -> None:
        pattern = self.hybrid_layer_pattern
        unknown = sorted(set(pattern) - set(PATTERN_SYMBOLS) - {"|"})
        if unknown:
            known = ", ".join(f"{s} ({kind})" for s, kind in PATTERN_SYMBOLS.items())
            raise ConfigError(
                f"hybrid_layer_pattern={pattern!r}: unknown symbol(s) {unknown}; use {known} "
                "and | (a pipeline-stage boundary)"
            )
        if any(n == 0 for n in self.pattern_stages):
            raise ConfigError(f"hybrid_layer_pattern={pattern!r}: a pipeline stage between | marks holds no layer")
        layers = len(self.block_kinds)
        if layers != self.n_layer:
            raise ConfigError(
                f"hybrid_layer_pattern={pattern!r} has {layers} layers but n_layer={self.n_layer}: "
                f"set n_layer to {layers}, or give one symbol per layer"
            )
        if self.attn_layer_idx:
            raise ConfigError(
                f"attn_layer_idx={self.attn_layer_idx!r} with hybrid_layer_pattern={pattern!r}: the "
                "pattern places the attention layers (*); use one of the two"
            )
        if MLP_LETTER in self.layer_pattern and self.d_intermediate == 0:
            raise ConfigError(
                f"hybrid_layer_pattern={pattern!r} has MLP layers (-) but d_intermediate=0: "
                "set d_intermediate to their hidden width"
            )
        if MLP_LETTER not in self.layer_pattern and self.d_intermediate:
            raise ConfigError(
                f"d_intermediate={self.d_intermediate} with hybrid_layer_pattern={pattern!r}, which has "
                "no MLP layers (-): with a pattern it is their width, no block holds an MLP inside; add "
                "- layers or set d_intermediate to 0"
            )

    def _validate_attention(self) -> None:
        known = {f.name for f in dataclasses.fields(AttentionOptions)}
        for key in self.attn_cfg:
            if key not in known:
                raise ConfigError(
                    f"attn_cfg.{key}={self.attn_cfg[key]!r} is not an option of mamba_ssm's MHA; known: {sorted(known)}"
                )
        if "num_heads" not in self.attn_cfg:
            raise ConfigError(f"attn_cfg={self.attn_cfg!r} has no num_heads: attention layers need their head count")
        o = self.attention_options
        _positive_int("attn_cfg.num_heads", o.num_heads)
        if o.num_heads_kv is not None:
            _positive_int("attn_cfg.num_heads_kv", o.num_heads_kv)
            if o.num_heads % o.num_heads_kv:
                raise ConfigError(
                    f"attn_cfg.num_heads_kv={o.num_heads_kv}: num_heads={o.num_heads} is not "
                    "divisible by it (each key/value head serves a whole group of query heads)"
                )
        if o.head_dim is not None:
            _positive_int("attn_cfg.head_dim", o.head_dim)
        elif self.d_model % o.num_heads:
            raise ConfigError(
                f"attn_cfg.num_heads={o.num_heads}: d_model={self.d_model} is not divisible by it; "
                "set attn_cfg.head_dim"
            )
        for name in ("qkv_proj_bias", "out_proj_bias", "causal", "rotary_emb_interleaved"):
            _boolean(f"attn_cfg.{name}", getattr(o, name))
        if not o.causal:
            raise ConfigError(
                "attn_cfg.causal=false: a language model's attention must be causal; set "
                '"causal": true (mamba_ssm\'s MHA defaults to false, its LM configs set it)'
            )
        for name, what in (("mlp_dim", "parallel MLP"), ("d_conv", "convolution")):
            if getattr(o, name) != 0:
                raise ConfigError(
                    f"attn_cfg.{name}={getattr(o, name)!r}: the attention layer's {what} is not implemented (use 0)"
                )
        if o.softmax_scale is not None:
            _positive_number("attn_cfg.softmax_scale", o.softmax_scale)
        head_dim = self.head_dim_of(o)
        rotary = o.rotary_emb_dim
        if isinstance(rotary, bool) or not isinstance(rotary, int) or rotary < 0 or rotary % 2 or rotary > head_dim:
            raise ConfigError(
                f"attn_cfg.rotary_emb_dim={rotary!r}: must be an even number of channels from 0 "
                f"(no rotary) to the head dim {head_dim}"
            )
        _positive_number("attn_cfg.rotary_emb_base", o.rotary_emb_base)

    def _validate_common(self, o: Union[Mamba1Options, Mamba2Options]) -> None:
        _positive_int("ssm_cfg.d_state", o.d_state)
        _positive_int("ssm_cfg.d_conv", o.d_conv)
        _positive_number("ssm_cfg.expand", o.expand)
        d_inner = o.expand * self.d_model
        if d_inner != int(d_inner):
            raise ConfigError(f"ssm_cfg.expand={o.expand!r}: expand * d_model = {d_inner} is not an integer")
        for name in ("conv_bias", "bias"):
            _boolean(f"ssm_cfg.{name}", getattr(o, name))
        _positive_number("ssm_cfg.dt_min", o.dt_min)
        _positive_number("ssm_cfg.dt_max", o.dt_max)
        if o.dt_min > o.dt_max:
            raise ConfigError(f"ssm_cfg.dt_min={o.dt_min!r} exceeds ssm_cfg.dt_max={o.dt_max!r}")
        if isinstance(o.dt_init_floor, bool) or not isinstance(o.dt_init_floor, (int, float)) or o.dt_init_floor < 0:
            raise ConfigError(f"ssm_cfg.dt_init_floor={o.dt_init_floor!r}: must be a number >= 0")

    def _validate_mamba1(self, o: Mamba1Options) -> None:
        if o.dt_rank != "auto":
            _positive_int("ssm_cfg.dt_rank", o.dt_rank)
        if o.dt_init not in ("random", "constant"):
            raise ConfigError(f"ssm_cfg.dt_init={o.dt_init!r}: only 'random' and 'constant' are implemented")
        _positive_number("ssm_cfg.dt_scale", o.dt_scale)
        _boolean("ssm_cfg.use_fast_path", o.use_fast_path)

    def _validate_mamba2(self, o: Mamba2Options) -> None:
        d_inner = self.d_inner
        if o.d_ssm is not None and o.d_ssm != d_inner:
            raise ConfigError(
                f"ssm_cfg.d_ssm={o.d_ssm!r}: an SSM narrower than d_inner={d_inner} (gated-MLP remainder) "
                "is not implemented (use null)"
            )
        _positive_int("ssm_cfg.headdim", o.headdim)
        if d_inner % o.headdim:
            raise ConfigError(
                f"ssm_cfg.headdim={o.headdim}: d_inner = expand * d_model = {d_inner} is not divisible by it"
            )
        _positive_int("ssm_cfg.ngroups", o.ngroups)
        nheads = d_inner // o.headdim
        if nheads % o.ngroups:
            raise ConfigError(
                f"ssm_cfg.ngroups={o.ngroups}: nheads = d_inner / headdim = {nheads} is not divisible by it"
            )
        lo, hi = o.A_init_range
        if not 0 < lo <= hi:
            raise ConfigError(f"ssm_cfg.A_init_range={list(o.A_init_range)!r}: need 0 < low <= high")
        lo, hi = o.dt_limit
        if not 0 <= lo < hi:
            raise ConfigError(f"ssm_cfg.dt_limit={list(o.dt_limit)!r}: need 0 <= low < high")
        if o.conv_init is not None:
            _positive_number("ssm_cfg.conv_init", o.conv_init)
        _positive_int("ssm_cfg.chunk_size", o.chunk_size)
        for name in ("D_has_hdim", "rmsnorm", "norm_before_gate", "use_mem_eff_path"):
            _boolean(f"ssm_cfg.{name}", getattr(o, name))

    def _validate_mamba3(self, o: Mamba3Options) -> None:
        for name in ("d_state", "headdim", "ngroups", "mimo_rank", "chunk_size"):
            _positive_int(f"ssm_cfg.{name}", getattr(o, name))
        for name in ("expand", "dt_min", "dt_max", "A_floor"):
            _positive_number(f"ssm_cfg.{name}", getattr(o, name))
        if o.dt_min > o.dt_max:
            raise ConfigError(f"ssm_cfg.dt_min={o.dt_min!r} exceeds ssm_cfg.dt_max={o.dt_max!r}")
        if isinstance(o.dt_init_floor, bool) or not isinstance(o.dt_init_floor, (int, float)) or o.dt_init_floor < 0:
            raise ConfigError(f"ssm_cfg.dt_init_floor={o.dt_init_floor!r}: must be a number >= 0")
        for name in ("is_outproj_norm", "is_mimo"):
            _boolean(f"ssm_cfg.{name}", getattr(o, name))
        d_inner = o.expand * self.d_model
        if d_inner != int(d_inner) or int(d_inner) % o.headdim:
            raise ConfigError(
                f"ssm_cfg.headdim={o.headdim}: d_inner = expand * d_model = {d_inner} is not a multiple of it"
            )
        nheads = int(d_inner) // o.headdim
        if nheads % o.ngroups:
            raise ConfigError(
                f"ssm_cfg.ngroups={o.ngroups}: nheads = d_inner / headdim = {nheads} is not divisible by it"
            )
        if o.rope_fraction not in (0.5, 1.0):
            raise ConfigError(f"ssm_cfg.rope_fraction={o.rope_fraction!r}: choose 0.5 or 1.0 (mamba_ssm's)")
        if o.num_rope_angles < 1:
            raise ConfigError(f"ssm_cfg.d_state={o.d_state}: rotates no pair at rope_fraction={o.rope_fraction}")
        if o.is_mimo and o.d_state % 2:
            raise ConfigError(
                f"ssm_cfg.d_state={o.d_state}: MIMO rotates dimensions i and i + d_state/2; use an even one"
            )
        if o.a_activation not in A_ACTIVATIONS:
            raise ConfigError(f"ssm_cfg.a_activation={o.a_activation!r}: choose one of {A_ACTIVATIONS}")

    # ---- config.json ---------------------------------------------------------------
    def to_dict(self) -> dict:
        """The config.json content: every field under mamba_ssm's name, and our hybrid fields unless at
        their defaults (so a config mamba_ssm can build is one it can read)."""
        data = json.loads(json.dumps(dataclasses.asdict(self)))
        for name in OWN_FIELDS:
            if data[name] == OWN_FIELDS[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "MambaConfig":
        """Build from a config.json dict; missing fields take mamba_ssm's defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if "model_type" in unknown:
            raise ConfigError(
                f"a transformers config (model_type {data['model_type']!r}), not ours: import its folder first, "
                "python -m megamamba.checkpoint.convert import --from hf --input FOLDER --output OUR_FOLDER"
            )
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def from_json(cls, path) -> "MambaConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))
