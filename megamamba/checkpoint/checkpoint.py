"""One checkpoint: what it holds and `Checkpoint` to read it (writer.py writes it).

Any layout reads any checkpoint, each rank only the pieces its own cut overlaps; safetensors and
JSON only, no unpickling; format versions 1 and 2 are still read. The directory's files:
docs/checkpoints.md ("The format and its code").
"""

import dataclasses
import functools
import json
import os
import re
from typing import Iterable, Mapping, Optional

import torch
from safetensors import safe_open

from megamamba.checkpoint import model_folder
from megamamba.checkpoint import rng as rng_files
from megamamba.checkpoint.files import CheckpointError, read_json
from megamamba.checkpoint.folder_tensors import FolderTensors, ModelFolderError
from megamamba.checkpoint.manifest import verify
from megamamba.checkpoint.store import resolve_load
from megamamba.config import ConfigError, MambaConfig
from megamamba.model.layers import EMBEDDING, HEAD
from megamamba.model.lm import MambaLM

CONFIG_FILE = model_folder.CONFIG_FILE
MODEL, OPTIMIZER = model_folder.WEIGHTS_STEM, "optimizer"
RNG_V1_FILE = "rng.safetensors"
_RNG_FILE = re.compile(r"rng-rank-(\d{5})\.safetensors")
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 3
READS = (1, 2, 3)


def rng_file(rank: int) -> str:
    return f"rng-rank-{rank:05d}.safetensors"


def parameter_shapes(config: MambaConfig) -> dict:
    """name -> full shape of every parameter the config implies (tied head left out)."""
    return dict(_parameter_shapes(json.dumps(config.to_dict(), sort_keys=True)))


@functools.lru_cache(maxsize=8)
def _parameter_shapes(config_json: str) -> tuple:
    with torch.device("meta"):  # no memory, but initialisation on meta tensors still costs ~0.1 s
        model = MambaLM(MambaConfig.from_dict(json.loads(config_json)))
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def check_model_shapes(shapes: Mapping[str, tuple], config: MambaConfig, source: str) -> None:
    """CheckpointError when the names or full shapes of the model tensors (tied head left out) do not fit the config."""
    expected = parameter_shapes(config)
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: tensors do not match the model config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, shape in shapes.items():
        if tuple(shape) != expected[name]:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(shape)}, the model config implies "
                f"{expected[name]} (full shapes, without tensor-parallel vocab padding)"
            )


def check_model_tensors(model: Mapping[str, torch.Tensor], config: MambaConfig, source: str) -> dict:
    """The model tensors without a (tied, equal) head; CheckpointError when names or shapes do not fit the config."""
    tensors = dict(model)
    if config.tie_embeddings and HEAD in tensors:
        if EMBEDDING in tensors and not torch.equal(tensors[HEAD].cpu(), tensors[EMBEDDING].cpu()):
            raise CheckpointError(f"{source}: tie_embeddings is true but {HEAD} differs from {EMBEDDING}")
        del tensors[HEAD]
    check_model_shapes({n: t.shape for n, t in tensors.items()}, config, source)
    return tensors


def config_differences(saved: MambaConfig, run: MambaConfig) -> list:
    """ "field: checkpoint X, run Y" for every field that differs (mixer, attention and mixture-of-experts options
    with defaults filled in, and the head width and key/value heads that null means)."""

    def flat(config: MambaConfig) -> dict:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("ssm_cfg", "attn_cfg", "moe_cfg")}
        if config.moe_cfg:
            moe = json.loads(json.dumps(dataclasses.asdict(config.moe_options)))
            fields.update({f"moe_cfg.{k}": v for k, v in moe.items()})
        fields["ssm_cfg.layer"] = config.layer
        options = json.loads(json.dumps(dataclasses.asdict(config.mixer_options)))
        fields.update({f"ssm_cfg.{k}": v for k, v in options.items()})
        if config.attn_cfg:
            o = config.attention_options
            attention = {
                **json.loads(json.dumps(dataclasses.asdict(o))),
                "head_dim": config.head_dim_of(o),
                "num_heads_kv": o.kv_heads,
            }
            fields.update({f"attn_cfg.{k}": v for k, v in attention.items()})
        return fields

    a, b = flat(saved), flat(run)
    return [f"{k}: checkpoint {a.get(k)!r}, run {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class Checkpoint:
    """A complete checkpoint, verified when opened (sizes, and sha256 unless hashes=False)."""

    def __init__(self, path: str, hashes: bool = True):
        self.path = path
        self.manifest = verify(path, hashes)
        self.tag = self.manifest["tag"]
        self.step = self.manifest["step"]
        self.state = read_json(os.path.join(path, STATE_FILE), "trainer state")
        if self.state.get("format_version") not in READS:
            raise CheckpointError(
                f"{os.path.join(path, STATE_FILE)}: format version "
                f"{self.state.get('format_version')!r}, this code reads {READS}"
            )
        config_path = os.path.join(path, CONFIG_FILE)
        try:
            self.config = MambaConfig.from_dict(read_json(config_path, "model config"))
        except (ConfigError, TypeError) as e:
            raise CheckpointError(f"{config_path}: {e}") from None

    @property
    def extra(self) -> dict:
        return self.state["extra"]

    def check_config(self, run: MambaConfig) -> None:
        """CheckpointError naming every field where the run's model config differs from the checkpoint's."""
        diff = config_differences(self.config, run)
        if diff:
            raise CheckpointError(
                f"{self.path}: the model config differs from the run's: {'; '.join(diff)}. "
                "Resume with the checkpoint's config.json, or start a new run (--load unset)"
            )

    def _read(self, stem: str, select) -> dict:
        """key -> local tensor, for `select(stored names)` = {key: (stored name, cut)} (cut None: the full tensor);
        the set's index (or headers) is read once."""
        try:
            with FolderTensors(self.path, stem) as tensors:
                return {key: tensors.read(name, cut) for key, (name, cut) in select(tensors.names()).items()}
        except ModelFolderError as e:
            raise CheckpointError(str(e)) from None

    def model_tensors(self, names: Optional[Iterable[str]] = None) -> dict:
        """Full parameters by mamba_ssm name (all, or `names`: e.g. one pipeline stage's), on the CPU.

        With tie_embeddings, asking for lm_head.weight gives the embedding.
        """
        if names is None:
            return check_model_tensors(
                self._read(MODEL, lambda stored: {n: (n, None) for n in stored}), self.config, self.path
            )
        return self.model_cuts({n: (n, None) for n in names})

    def model_cuts(self, requests: Mapping[str, tuple]) -> dict:
        """key -> the local tensor `cut` of parameter `name` for each key's (name, cut) (cut None: the full one),
        reading only the stored pieces it overlaps. With tie_embeddings lm_head.weight is the embedding."""
        tied = self.config.tie_embeddings
        return self._read(
            MODEL, lambda _: {k: (EMBEDDING if tied and n == HEAD else n, c) for k, (n, c) in requests.items()}
        )

    def optimizer_tensors(self, names: Optional[Iterable[str]] = None) -> dict:
        """Full optimizer state "<name>/<key>" of all parameters, or of the parameters in `names`."""
        wanted = None if names is None else set(names)
        return self._read(
            OPTIMIZER, lambda stored: {k: (k, None) for k in stored if wanted is None or k.rpartition("/")[0] in wanted}
        )

    def optimizer_cuts(self, requests: Mapping[str, tuple]) -> dict:
        """key -> {state key: local tensor} for each key's (parameter name, cut): every optimizer state stored
        for that parameter, cut like it (a 0-d state whole); {} for a parameter without state."""

        def select(stored) -> dict:
            keys: dict = {}
            for name in stored:
                parameter, _, state_key = name.rpartition("/")
                keys.setdefault(parameter, []).append(state_key)
            return {(key, k): (f"{name}/{k}", cut) for key, (name, cut) in requests.items() for k in keys.get(name, ())}

        out: dict = {key: {} for key in requests}
        for (key, state_key), t in self._read(OPTIMIZER, select).items():
            out[key][state_key] = t
        return out

    @property
    def optimizer_groups(self) -> list:
        return self.state["optimizer"]["param_groups"]

    @property
    def scheduler(self) -> Optional[dict]:
        return self.state["scheduler"]

    def rng_state(self, rank: int, world_size: int) -> dict:
        """The RNG states rank `rank` of `world_size` restores: its own when as many ranks saved, else rank 0's."""
        if self.state["format_version"] == 1:
            path = os.path.join(self.path, RNG_V1_FILE)
            with safe_open(path, framework="pt") as f:
                states = rng_files.from_file({k: f.get_tensor(k) for k in f.keys()}, f.metadata())
            return states[rank] if len(states) == world_size else states[0]
        saved = sorted(int(m.group(1)) for m in map(_RNG_FILE.fullmatch, self.manifest["files"]) if m)
        if saved != list(range(len(saved))) or not saved:
            raise CheckpointError(f"{self.path}: RNG files of ranks {saved[:8]}, expected ranks 0..N-1")
        path = os.path.join(self.path, rng_file(rank if len(saved) == world_size else 0))
        with safe_open(path, framework="pt") as f:
            return rng_files.from_file({k: f.get_tensor(k) for k in f.keys()}, f.metadata())[0]


def open_checkpoint(load: str, save_dir: Optional[str] = None, hashes: bool = True) -> Checkpoint:
    """The checkpoint a `--load` value names ("auto", a checkpoint directory, or a save directory)."""
    return Checkpoint(resolve_load(load, save_dir, hashes), hashes=False)
