"""Compatibility re-export: the cost models live in the ``costmodel`` package now.

Kept until engine/llm.py moves to ``from costmodel import CostModel``; remove after.
"""

from costmodel import DEFAULT_CHUNK_BUDGET, CostModel, DecodeCostModel

__all__ = ["DEFAULT_CHUNK_BUDGET", "CostModel", "DecodeCostModel"]
