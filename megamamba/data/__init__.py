"""Data: raw text -> token datasets (.bin/.idx) -> blended, packed, layout-free global batches.

    python -m megamamba.data.corpus_dump --output corpus.jsonl          # the built-in corpus as JSONL
    python -m megamamba.tokenizer.train --input corpus.jsonl --vocab-size 4096 --output-prefix spm
    python -m megamamba.data.preprocess --input corpus.jsonl --tokenizer spm.model \\
        --output-prefix corpus --workers 4 --valid-fraction 0.02        # corpus_train, corpus_valid

Modules: documents (input files), indexed (the Megatron .bin/.idx format), preprocess, blend
(`--data 0.7 a 0.3 b` and the deterministic mixing schedule), packing (documents -> fixed-length
samples with document ids) and epoch_index (a large dataset's packing arrays, built once and
memory-mapped), batches (`PackedGlobalBatches`, the training data path), split (`--split`),
vocab_check (the vocabulary check, done once per dataset).
"""
