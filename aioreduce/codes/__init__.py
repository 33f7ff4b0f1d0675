"""Gradient codes, CodedReduce placement and cost models: pure numpy, no IO.

Public names (other code and tools are written against them)::

    from aioreduce.codes import (frc, cyclic_mds, random_cyclic, gaussian_mds, TreeTopology,
                                 coded_tree_plan, NotDecodable)
"""

from .comm_efficient import gaussian_mds, group_code, polynomial_code
from .constructions import cyclic_mds, default_code, frc, random_cyclic
from .gradient import (
    FP32_BUDGET,
    Approximation,
    GradientCode,
    NotDecodable,
    Stability,
    StabilityWarning,
)
from .planner import CodedTreePlan, coded_tree_plan, coded_tree_unit
from .topology import TreeTopology

__all__ = [
    "FP32_BUDGET",
    "Approximation",
    "CodedTreePlan",
    "GradientCode",
    "NotDecodable",
    "Stability",
    "StabilityWarning",
    "TreeTopology",
    "coded_tree_plan",
    "coded_tree_unit",
    "cyclic_mds",
    "default_code",
    "frc",
    "gaussian_mds",
    "group_code",
    "polynomial_code",
    "random_cyclic",
]
