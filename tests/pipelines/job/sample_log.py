"""A training rank that also returns the global samples it trained on, for comparing sample streams.

`run_train_logging_samples(argv, extensions_dir)` runs launch/train.py's main on this rank with
`PackedGlobalBatches.micro_batches_at` wrapped: every micro-batch is logged as its first global
sample number and its input rows. Top-level, so tests/distributed.run_ranks can spawn it.
"""

from train_entry import run_train


def run_train_logging_samples(argv, extensions_dir) -> dict:
    from megamamba.data.batches import PackedGlobalBatches

    logged = []
    original = PackedGlobalBatches.micro_batches_at

    def micro_batches_at(self, first_sample, dp_rank, dp_size, micro_batch_size, window=None):
        batches = original(self, first_sample, dp_rank, dp_size, micro_batch_size, window)
        first = first_sample + dp_rank * (self.global_batch_size // dp_size)
        for k, (inputs, _, _) in enumerate(batches):
            logged.extend((first + k * micro_batch_size + row, inputs[row].tolist()) for row in range(len(inputs)))
        return batches

    PackedGlobalBatches.micro_batches_at = micro_batches_at
    try:
        return {**run_train(argv, extensions_dir), "samples": logged}
    finally:
        PackedGlobalBatches.micro_batches_at = original
