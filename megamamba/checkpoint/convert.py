"""Convert between our checkpoints / model folders and Hugging Face or mamba_ssm weights.

    python -m megamamba.checkpoint.convert export --checkpoint DIR [--tag step_000100] --output DIR [--to hf|mamba_ssm]
                                      [--max-shard-size 5GB] [--no-tokenizer]
    python -m megamamba.checkpoint.convert import --from hf|mamba_ssm --input DIR --output MODEL_DIR

transformers' format is Mamba / Mamba2 for Mamba-only models and NemotronH for hybrids.

Nothing is unpickled and nothing overwritten unless --overwrite is given (then the old folder is replaced
only once the new one is complete); refusals are one line, exit status 2.
Usage and formats: docs/checkpoints.md ("Converting to and from Hugging Face and mamba_ssm").
"""

import argparse
import math
import os
import shutil
import sys

import torch
from safetensors import SafetensorError

from megamamba.checkpoint.checkpoint import Checkpoint, check_model_shapes, check_model_tensors, parameter_shapes
from megamamba.checkpoint.export_formats import refusal_message
from megamamba.checkpoint.files import (
    CheckpointError,
    fsync_file,
    read_json,
    read_tensors,
    remove_tree,
    rename,
    sync_dir,
    write_bytes,
    write_json,
)
from megamamba.checkpoint.finite import DamagedWeightsError, check_finite
from megamamba.checkpoint.hf import HFFormatError, decode_special_floats
from megamamba.checkpoint.mamba_ssm_format import mamba_ssm_config
from megamamba.checkpoint.model_card import CARD_FILE, model_card, training_facts
from megamamba.checkpoint.model_folder import CONFIG_FILE, WEIGHTS_FILE, ModelFolderError, save_model_folder
from megamamba.checkpoint.safetensors_stream import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
    TensorReader,
    TensorSpec,
    parse_size,
    write_sharded,
)
from megamamba.checkpoint.store import checkpoint_tags, resolve_model_folder
from megamamba.checkpoint.transformers_formats import (
    GENERATION_CONFIG_FILE,
    assemble,
    export_config,
    file_names,
    file_parts,
    generation_config,
    import_config,
    zero_tensors,
)
from megamamba.config import ConfigError, MambaConfig
from megamamba.errors import MegamambaError
from megamamba.model.layer_types.head import tie
from megamamba.model.layers import EMBEDDING, HEAD
from megamamba.model.lm import MambaLM
from megamamba.tokenizer import TokenizerError, find_tokenizer, load_tokenizer
from megamamba.tokenizer.transformers_export import write_transformers_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
SHARD_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"


class ConvertError(MegamambaError):
    """Input that cannot be converted; the message names the file or field."""


def _source(directory: str, tag: str = None) -> tuple:
    """(config, folder holding the weights) of a checkpoint (verified), save directory or model folder."""
    if tag:
        if not os.path.isdir(os.path.join(directory, tag)):
            found = checkpoint_tags(directory) if os.path.isdir(directory) else []
            held = f"it holds {', '.join(found[:5])}{', ...' if len(found) > 5 else ''}" if found else "it holds none"
            raise ConvertError(f"--tag {tag}: {directory} has no checkpoint {tag} ({held}); name one of its tags")
        ckpt = Checkpoint(os.path.join(directory, tag))
        return ckpt.config, ckpt.path
    folder, verified = resolve_model_folder(directory)
    if verified:
        return Checkpoint(folder, hashes=False).config, folder
    print(
        f"convert: note: {folder} has no manifest.json: reading it as a plain model folder, without checksums",
        file=sys.stderr,
        flush=True,
    )
    return _our_config(os.path.join(directory, CONFIG_FILE)), directory


def _checked_names(reader: TensorReader, config: MambaConfig) -> list:
    """Our tensor names in model order, checked against the config on headers (a tied head left out).

    A tied head the folder holds anyway must equal the embedding (the two are compared).
    """
    names = set(reader.names())
    if config.tie_embeddings and HEAD in names:
        if EMBEDDING in names and not torch.equal(reader.load(HEAD), reader.load(EMBEDDING)):
            raise ConvertError(f"{reader.directory}: tie_embeddings is true but {HEAD} differs from {EMBEDDING}")
        names.discard(HEAD)
    check_model_shapes({n: reader.spec(n).shape for n in names}, config, reader.directory)
    return list(parameter_shapes(config))


def _export_tensors(reader: TensorReader, config: MambaConfig, model_type: str) -> tuple:
    """(specs of the file's tensors in model order, load(name in the file) -> tensor): each a row range of ours (a
    stacked part its one row), then the format's zero tensors (float32)."""
    specs, sources = [], {}
    for name in file_names(model_type, _checked_names(reader, config)):
        held = EMBEDDING if name == HEAD and config.tie_embeddings else name
        spec, start = reader.spec(held), 0
        for part in file_parts(model_type, config, name):
            rows = spec.shape[0] if part.rows is None else part.rows
            shape = spec.shape[1:] if part.stacked else (rows, *spec.shape[1:])
            specs.append(TensorSpec(part.name, spec.dtype, tuple(shape)))
            sources[part.name] = (held, start, rows, part.stacked)
            start += rows
    zeros = zero_tensors(model_type, config)
    specs += [TensorSpec(name, "F32", shape) for name, shape in zeros.items()]

    def load(name: str) -> torch.Tensor:
        if name in zeros:
            return torch.zeros(zeros[name])
        held, start, rows, stacked = sources[name]
        tensor = reader.load(held).narrow(0, start, rows)
        return tensor.squeeze(0) if stacked else tensor

    return specs, load


def _our_config(path: str) -> MambaConfig:
    try:
        return MambaConfig.from_dict(read_json(path, "model config"))
    except (ConfigError, TypeError) as e:
        raise ConvertError(f"{path}: {e}") from None


def _tokenizer_files(directory: str) -> list:
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]


def _occupied(output: str) -> bool:
    """Whether `output` exists and is not an empty directory (which a conversion would replace)."""
    return os.path.exists(output) and (not os.path.isdir(output) or bool(os.listdir(output)))


def _staging(output: str) -> str:
    """A fresh directory beside `output`, which must not exist or be empty."""
    if _occupied(output):
        raise ConvertError(
            f"--output {output}: exists and is not an empty directory; choose another --output or pass --overwrite "
            "to replace it"
        )
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".tmp-{os.path.basename(os.path.abspath(output))}-{os.getpid()}")
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.mkdir(staging)
    return staging


def _finish(staging: str, output: str, tokenizer_source: str = None) -> None:
    """Copy the tokenizer files (of `tokenizer_source`, if given), fsync everything and rename staging to `output`."""
    if tokenizer_source is not None:
        for name in _tokenizer_files(tokenizer_source):
            shutil.copyfile(os.path.join(tokenizer_source, name), os.path.join(staging, name))
    for name in os.listdir(staging):
        fsync_file(os.path.join(staging, name))
    sync_dir(staging)
    rename(staging, output)


def _check_exportable(config: MambaConfig, target: str) -> None:
    """ConvertError with every reason `--to target` cannot compute the model, before anything is written."""
    message = refusal_message(config, target)
    if message:
        raise ConvertError(message)


def export_hf(
    directory: str, output: str, tag: str = None, max_shard_size=DEFAULT_MAX_SHARD_SIZE, tokenizer: bool = True
) -> str:
    """Write transformers' folder for the checkpoint / model folder `directory`; returns `output`.

    Tensors stream one at a time (sharded above `max_shard_size`); tokenizer=False writes no tokenizer files.
    """
    try:
        parse_size(max_shard_size)
    except ValueError as e:
        raise ConvertError(f"--max-shard-size {e}") from None
    config, source = _source(directory, tag)
    _check_exportable(config, "hf")
    spec = find_tokenizer(source) if tokenizer else None
    try:
        ours = load_tokenizer(spec) if spec is not None else None
        with TensorReader(source) as reader:
            hf = export_config(config, DTYPES[reader.spec(EMBEDDING).dtype], ours.eod if ours is not None else None)
            specs, load = _export_tensors(reader, config, hf["model_type"])
            staging = _staging(output)
            try:
                write_json(os.path.join(staging, CONFIG_FILE), hf)
                if ours is not None:
                    write_transformers_tokenizer(ours, staging)
                    write_json(os.path.join(staging, GENERATION_CONFIG_FILE), generation_config(hf, ours.vocab_size))
                write_sharded(staging, specs, load, max_shard_size)
                parameters = sum(math.prod(spec.shape) for spec in specs)
                card = model_card(config, hf, parameters, training_facts(source))
                write_bytes(os.path.join(staging, CARD_FILE), card.encode())
            except BaseException:
                shutil.rmtree(staging)
                raise
    except ModelFolderError as e:
        raise ConvertError(str(e)) from None
    except TokenizerError as e:
        raise ConvertError(f"{e}; not exported: --no-tokenizer exports the model without tokenizer files") from None
    _finish(staging, output)
    return output


def export_mamba_ssm(directory: str, output: str, tag: str = None, tokenizer: bool = True) -> str:
    """Write mamba_ssm's folder (config.json + pytorch_model.bin, as its from_pretrained reads) for the checkpoint /
    model folder `directory`, with our tokenizer's files unless tokenizer=False; returns `output`."""
    config, source = _source(directory, tag)
    _check_exportable(config, "mamba_ssm")
    fields = mamba_ssm_config(config)
    try:
        with TensorReader(source) as reader:
            state = {name: reader.load(name) for name in _checked_names(reader, config)}
    except ModelFolderError as e:
        raise ConvertError(str(e)) from None
    if config.tie_embeddings:
        state[HEAD] = state[EMBEDDING]  # mamba_ssm's state dict names the tied head too (one storage, saved once)
    staging = _staging(output)
    try:
        write_json(os.path.join(staging, CONFIG_FILE), fields)
        torch.save(state, os.path.join(staging, TORCH_WEIGHTS))
    except BaseException:
        shutil.rmtree(staging)
        raise
    _finish(staging, output, source if tokenizer else None)
    return output


def _read_weights(directory: str) -> dict:
    """The tensors `directory` stores (`_stored_weights`), checked finite."""
    state = _stored_weights(directory)
    try:
        check_finite(state, directory)
    except DamagedWeightsError as e:
        raise ConvertError(str(e)) from None
    return state


def _stored_weights(directory: str) -> dict:
    """Tensors of model.safetensors, a sharded safetensors set, or pytorch_model.bin (weights_only)."""
    single, index, torch_file = (os.path.join(directory, n) for n in (WEIGHTS_FILE, SHARD_INDEX, TORCH_WEIGHTS))
    if os.path.isfile(single):
        return read_tensors(single)
    if os.path.isfile(index):
        weight_map = read_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConvertError(f"{index}: no weight_map")
        state = {}
        for shard in sorted(set(weight_map.values())):
            state.update(read_tensors(os.path.join(directory, shard)))
        return state
    if os.path.isfile(torch_file):
        try:
            return torch.load(torch_file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling refusal or damage: one message
            reason = " ".join(str(e).split())
            raise ConvertError(
                f"{torch_file}: not loadable with weights_only=True, which refuses pickled code ({reason})"
            ) from None
    raise ConvertError(f"{directory}: holds none of {WEIGHTS_FILE}, {SHARD_INDEX}, {TORCH_WEIGHTS}")


def _from_transformers(tensors: dict, config: MambaConfig, model_type: str, directory: str) -> dict:
    """Our tensors from transformers' (parts put together); ConvertError naming a missing or unexpected one."""
    names = list(parameter_shapes(config))
    if HEAD not in names and HEAD in tensors:
        names.append(HEAD)  # a tied head written anyway: check_model_tensors compares it with the embedding
    state, used = {}, set()
    for name in file_names(model_type, names):
        parts = file_parts(model_type, config, name)
        missing = [p.name for p in parts if p.name not in tensors]
        if missing:
            raise ConvertError(f"{directory}: has no tensor {missing[0]} (part of our {name}) that its config implies")
        state[name] = assemble(config, name, parts, tensors.__getitem__)
        used.update(p.name for p in parts)
    for name in zero_tensors(model_type, config):
        if name in tensors and tensors[name].any():
            raise ConvertError(
                f"{directory}: {name} is not zero, but its config.json's moe_cfg.expert_bias=false has no "
                "such bias; set it true there to import the bias"
            )
        used.add(name)
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise ConvertError(f"{directory}: tensors its config does not imply: {unexpected[:5]}")
    return state


def import_weights(source_format: str, directory: str, output: str) -> str:
    """Write our model folder from transformers' (`"hf"`) or mamba_ssm's (`"mamba_ssm"`) folder; returns `output`."""
    config_path = os.path.join(directory, CONFIG_FILE)
    if source_format == "hf":
        hf = decode_special_floats(read_json(config_path, "transformers config"))
        try:
            config = import_config(hf)
        except (HFFormatError, ConfigError) as e:
            raise ConvertError(f"{config_path}: {e}") from None
        state = _from_transformers(_read_weights(directory), config, hf["model_type"], directory)
    elif source_format == "mamba_ssm":
        config = _our_config(config_path)
        state = _read_weights(directory)
    else:
        raise ConvertError(f"--from {source_format!r}: choose hf or mamba_ssm")
    state = check_model_tensors(state, config, directory)
    with torch.device("meta"):
        model = MambaLM(config)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        tie(model.lm_head, model.backbone.embedding)
    staging = _staging(output)
    save_model_folder(model, staging)
    _finish(staging, output, directory)
    return output


OVERWRITE_HELP = "replace an existing --output model folder (one holding config.json); without it: refused"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="checkpoint or model folder -> Hugging Face transformers or mamba_ssm folder")
    e.add_argument("--checkpoint", required=True, help="checkpoint, save directory (uses latest) or model folder")
    e.add_argument("--tag", default=None, help="checkpoint in the save directory, e.g. step_000100")
    e.add_argument("--output", required=True)
    e.add_argument(
        "--to",
        dest="target",
        default="hf",
        choices=["hf", "mamba_ssm"],
        help="hf: transformers' Mamba / Mamba2, NemotronH for hybrids (default); mamba_ssm: config.json + "
        "pytorch_model.bin for its MambaLMHeadModel.from_pretrained",
    )
    e.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help="(--to hf) largest weights file, e.g. 5GB (10**9 bytes), 4GiB or a byte count; above it the "
        "weights are sharded with an index, as transformers shards",
    )
    e.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    e.add_argument(
        "--no-tokenizer",
        dest="tokenizer",
        action="store_false",
        help="write no tokenizer files (when the source's tokenizer cannot be exported: the refusal says why)",
    )
    i = sub.add_parser("import", help="Hugging Face or mamba_ssm folder -> our model folder")
    i.add_argument("--from", dest="source_format", required=True, choices=["hf", "mamba_ssm"])
    i.add_argument("--input", required=True)
    i.add_argument("--output", required=True)
    i.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    return p.parse_args(argv)


def _convert(args: argparse.Namespace, output: str) -> str:
    if args.command == "export" and args.target == "mamba_ssm":
        return export_mamba_ssm(args.checkpoint, output, args.tag, args.tokenizer)
    if args.command == "export":
        return export_hf(args.checkpoint, output, args.tag, args.max_shard_size, args.tokenizer)
    return import_weights(args.source_format, args.input, output)


def _replacing(args: argparse.Namespace) -> str:
    """Convert into a fresh folder beside --output, then swap it in: the old folder stays whole until then."""
    output = args.output
    if not os.path.isfile(os.path.join(output, CONFIG_FILE)):
        raise ConvertError(
            f"--output {output}: has no {CONFIG_FILE}, and --overwrite replaces only a model folder; choose "
            f"another --output, or remove {output} yourself"
        )
    parent, name = os.path.split(os.path.abspath(output))
    new, old = (os.path.join(parent, f".{kind}-{name}-{os.getpid()}") for kind in ("new", "old"))
    _convert(args, new)
    rename(output, old)
    rename(new, output)
    remove_tree(old)
    return output


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        out = _replacing(args) if args.overwrite and _occupied(args.output) else _convert(args, args.output)
    except (ConvertError, CheckpointError, HFFormatError, SafetensorError, TokenizerError) as e:
        print(f"convert {args.command}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"convert {args.command}: wrote {out}")


if __name__ == "__main__":
    main()
