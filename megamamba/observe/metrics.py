"""Training metrics: one record per logged step to the console, a JSON-lines file, TensorBoard, CSV files
and wandb (the writers of `megamamba.observe.monitors`; which ones a run uses: `megamamba.observe.monitor_config`).

Names (docs/architecture.md): step, loss, lr, grad_norm, tokens_per_s, tflops_per_device, mem_peak_gb and,
when known, val_loss and mfu, each mixture-of-experts layer's figures (moe_layer{i}_...), then elapsed_s (since
the job started) and eta_s (of the remaining steps). The same names are the JSONL keys, the TensorBoard tags
(global step = `step`), the CSV files and the wandb keys; the console shows `step N/TOTAL` (N counts from 0, as
`step` does) and the times as h:mm:ss. Only the rank that creates the logger `enabled` writes; the others make it
a no-op, so callers need not branch on rank.
"""

from typing import Optional

from megamamba.data.progress import clock
from megamamba.observe.monitors import CsvMonitor, JsonlMonitor, TensorBoardMonitor, WandbMonitor

METRIC_NAMES = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tflops_per_device",
    "mem_peak_gb",
    "val_loss",
    "mfu",
    "elapsed_s",
    "eta_s",
)
MOE_METRIC_PREFIX = "moe_layer"  # moe_layer{i}_<figure>: a mixture-of-experts layer's (pipelines/loop/moe_metrics.py)
_TIMES = {"elapsed_s": "elapsed", "eta_s": "ETA"}


def _field(name: str, value, total_steps: Optional[int]) -> str:
    if name == "step" and total_steps is not None:
        return f"step {value}/{total_steps}"
    if name in _TIMES:
        return f"{_TIMES[name]} {clock(value)}"
    return f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"


def format_record(record: dict, total_steps: Optional[int] = None) -> str:
    """`step 3/100 | loss 5.123 | ... | elapsed 0:01:02 | ETA 0:20:40`, 4 significant digits for floats."""
    return " | ".join(_field(k, v, total_steps) for k, v in record.items())


class MetricsLogger:
    def __init__(
        self,
        enabled: bool,
        jsonl_path: Optional[str] = None,
        tensorboard_dir: Optional[str] = None,
        total_steps: Optional[int] = None,
        csv_dir: Optional[str] = None,
        wandb: Optional[dict] = None,
    ):
        """`wandb`: the keyword arguments of wandb.init, None for no wandb run."""
        self.enabled = enabled
        self.total_steps = total_steps
        self._monitors = []
        if not enabled:
            return
        for value, monitor in (
            (jsonl_path, JsonlMonitor),
            (tensorboard_dir, TensorBoardMonitor),
            (csv_dir, CsvMonitor),
            (wandb, WandbMonitor),
        ):
            if value is not None and value != "":  # an empty path (--metrics-jsonl "") is off
                self._monitors.append(monitor(value))

    def log(self, record: dict) -> None:
        """Write one step's record; keys must be METRIC_NAMES or MoE layers' figures, `step` first; None values
        are left out."""
        if not self.enabled:
            return
        unknown = {k for k in record if k not in METRIC_NAMES and not k.startswith(MOE_METRIC_PREFIX)}
        if unknown:
            raise KeyError(f"unknown metric name(s) {sorted(unknown)}; known: {METRIC_NAMES}")
        record = {k: v for k, v in record.items() if v is not None}
        print(format_record(record, self.total_steps), flush=True)
        for monitor in self._monitors:
            monitor.write(record)

    def close(self) -> None:
        for monitor in self._monitors:
            monitor.close()
