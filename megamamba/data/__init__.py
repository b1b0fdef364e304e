"""Data: raw text -> token datasets (.bin/.idx) -> blended, packed, layout-free global batches.

The steps from raw text, and what each module of this package does: docs/data.md.
"""
