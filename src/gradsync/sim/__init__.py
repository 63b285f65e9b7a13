"""Alpha-beta cost model and trace-driven iteration simulator (``gradsync simulate``).

Modules: :mod:`.costmodel` (collective times), :mod:`.profile` (the :class:`Profile` type and its
JSON form), :mod:`.plans` (what each algorithm sends), :mod:`.engine` (:func:`simulate`,
:func:`sweep`). :func:`plot_scaling` lives in :mod:`gradsync.report.scaling`.
"""

from gradsync.report.scaling import plot_scaling
from gradsync.sim.costmodel import (
    COLLECTIVES,
    Network,
    allgather_time,
    allreduce_time,
    collective_time,
    fit_alpha_beta,
    reduce_scatter_time,
    sparse_allgather_time,
)
from gradsync.sim.engine import Result, simulate, sweep
from gradsync.sim.plans import (
    PLANS,
    AlgorithmPlan,
    BucketPlan,
    CommStep,
    CovapSimPlan,
    DeARPlan,
    DensePlan,
    FP16Plan,
    PeriodicPlan,
    PowerSGDPlan,
    TopKPlan,
    make_plan,
)
from gradsync.sim.profile import SCHEMA, Profile, ProfileBucket, load_profile, synthetic_profile

__all__ = [
    "COLLECTIVES",
    "PLANS",
    "SCHEMA",
    "AlgorithmPlan",
    "BucketPlan",
    "CommStep",
    "CovapSimPlan",
    "DeARPlan",
    "DensePlan",
    "FP16Plan",
    "PeriodicPlan",
    "Network",
    "PowerSGDPlan",
    "Profile",
    "ProfileBucket",
    "Result",
    "TopKPlan",
    "allgather_time",
    "allreduce_time",
    "collective_time",
    "fit_alpha_beta",
    "load_profile",
    "make_plan",
    "plot_scaling",
    "reduce_scatter_time",
    "simulate",
    "sparse_allgather_time",
    "sweep",
    "synthetic_profile",
]
