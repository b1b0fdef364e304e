"""Training runs shared by the tests that compare whole runs: each distinct run happens once per session,
whichever xdist worker asks first (tests/run_cache.py).

Models: the tiny Mamba-1 / Mamba-2 / hybrid configs of launch/models with n_layer = 3, which two
pipeline stages cannot split evenly; the hybrid's 3 layers are one of each kind ("M*-"), with one
key/value head, which TP 2 replicates; "mamba3-mimo-hybrid" is tiny-mamba3-hybrid.json with
tiny-mamba3-mimo.json's ssm_cfg. Runs go through the real `deepspeed` launcher (`launched`)
or through ranks spawned directly by tests/distributed.py (`spawned`), both on gloo. The fixtures
`train_runs`, `train_reference` and `packed_documents` serve every test (tests/conftest.py).
"""

import hashlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from distributed import free_port, run_ranks
from run_cache import RunCache, shared_dir, write_atomically
from train_entry import DEEPSPEED, ROOT, TRAIN_PY, read_metrics, run_train

N_LAYER = 3
HYBRID_PATTERN = "M*-"
DS_CONFIG = ROOT / "launch/configs/tiny-cpu.json"
COMMON = [
    "--train-iters",
    "5",
    "--seq-length",
    "32",
    "--log-interval",
    "1",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-warmup-iters",
    "1",
    "--eval-interval",
    "5",
    "--eval-iters",
    "1",
    "--seed",
    "1234",
]


def relative_curve_error(curve, reference):
    """max over steps of |loss - reference| / |reference|."""
    assert len(curve) == len(reference), (curve, reference)
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


def losses(records, key="loss"):
    return [r[key] for r in records if key in r]


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self._cache = RunCache(root)
        self.extensions_dir = os.environ["TORCH_EXTENSIONS_DIR"]

    def model_config(self, mixer: str) -> str:
        path = self.root / f"tiny-{mixer}-{N_LAYER}l.json"
        if not path.exists():
            if mixer == "mamba3-mimo-hybrid":  # the Mamba-3 hybrid with MIMO layers
                config = json.loads((ROOT / "launch/models/tiny-mamba3-hybrid.json").read_text())
                config["ssm_cfg"] = json.loads((ROOT / "launch/models/tiny-mamba3-mimo.json").read_text())["ssm_cfg"]
            else:
                config = json.loads((ROOT / f"launch/models/tiny-{mixer}.json").read_text())
            config["n_layer"] = N_LAYER
            if mixer == "hybrid":
                config.update(hybrid_layer_pattern=HYBRID_PATTERN, attn_cfg={**config["attn_cfg"], "num_heads_kv": 1})
            write_atomically(path, json.dumps(config))
        return str(path)

    def ds_config(self, **changes) -> str:
        config = {**json.loads(DS_CONFIG.read_text()), **changes}
        path = self.root / f"ds-{hashlib.md5(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]}.json"
        write_atomically(path, json.dumps(config))
        return str(path)

    def _argv(self, mixer, flags, ds_config, out):
        return [
            "--deepspeed_config",
            ds_config or str(DS_CONFIG),
            "--model-config",
            self.model_config(mixer),
            "--metrics-jsonl",
            str(out / "metrics.jsonl"),
            *COMMON,
            *flags,
        ]

    def spawned(self, world: int, mixer: str, flags=(), ds_config=None, faults=None) -> list:
        """Rank summaries of a run on `world` directly spawned ranks, with `faults` (tests/fault_injection.py's
        `install` keywords) injected."""
        key = ("spawned", world, mixer, tuple(flags), ds_config, json.dumps(faults, sort_keys=True))
        return self._cache.get(
            key,
            lambda out: run_ranks(
                run_train,
                world,
                args=(self._argv(mixer, flags, ds_config, out), self.extensions_dir, faults),
                init_process_group=False,
                timeout=300,
            ),
        )

    def launched(self, world: int, mixer: str, flags=(), ds_config=None) -> dict:
        """`deepspeed --num_gpus world launch/train.py ...`: its stdout, exit code and JSONL records."""
        key = ("launched", world, mixer, tuple(flags), ds_config)
        return self._cache.get(key, lambda out: self._launch(world, mixer, flags, ds_config, out))

    def _launch(self, world, mixer, flags, ds_config, out: Path) -> dict:
        cmd = [
            str(DEEPSPEED),
            "--num_gpus",
            str(world),
            "--master_port",
            str(free_port()),
            str(TRAIN_PY),
            *self._argv(mixer, flags, ds_config, out),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
        return {
            "returncode": proc.returncode,
            "stdout": proc.stdout,
            "stderr": proc.stderr,
            "records": read_metrics(out / "metrics.jsonl"),
            "dir": out,
        }


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory):
    return Runs(shared_dir(tmp_path_factory, "train_runs"))


@pytest.fixture(scope="session")
def packed_documents(tmp_path_factory):
    """--data / --valid-data flags of the built-in corpus cut into its lines, one short document each
    (bytes; several document boundaries in every 32-token sample)."""
    from megamamba.data.corpus import python_docs
    from megamamba.data.preprocess import preprocess

    def make(root: Path) -> list:
        corpus = root / "lines.jsonl"
        with open(corpus, "w") as f:
            for doc in python_docs()[:20]:
                for line in doc.split("\n"):
                    if line.strip():
                        f.write(json.dumps({"text": line.strip()}) + "\n")
        train, valid = preprocess(
            [str(corpus)], "bytes", str(root / "lines"), valid_fraction=0.1, progress_stream=io.StringIO()
        )
        return ["--data", train, "--valid-data", valid]

    return RunCache(shared_dir(tmp_path_factory, "packed_documents")).get("packed_documents", make)


@pytest.fixture(scope="session")
def train_reference(train_runs):
    """The (1,1,1) float32 run of a mixer, through the real launcher."""

    def get(mixer):
        run = train_runs.launched(1, mixer)
        assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
        return run

    return get
