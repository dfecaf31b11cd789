"""autopar: automatic parallelization planner and compiler for PyTorch training.

    import autopar
    cluster = autopar.Cluster.preset("dgx-a100-80g", nodes=4)
    plan = autopar.plan(model, cluster, example_inputs)
    trainer = autopar.compile(model, cluster, example_inputs, loss_fn=loss_fn)  # on every rank
    loader = autopar.data_loader(trainer, dataset)  # this rank's local batches
    log = autopar.StepLog(trainer, every=10)        # one log line every 10 steps
"""

from autopar.api import compile, plan, search_plans
from autopar.errors import AutoparError, CaptureError, ConfigError, InfeasibleError, PlanError
from autopar.planner.estimators import ANALYTIC, CostContext, Estimators
from autopar.report import format_plan
from cost_models.hardware import Cluster
from runtime.batch import Inputs
from runtime.data import ShardedLoader, data_loader
from runtime.plan import LayerPlan, Mesh, Plan
from runtime.step_log import StepLog

__all__ = [
    "ANALYTIC",
    "AutoparError",
    "CaptureError",
    "Cluster",
    "ConfigError",
    "CostContext",
    "Estimators",
    "InfeasibleError",
    "Inputs",
    "LayerPlan",
    "Mesh",
    "Plan",
    "PlanError",
    "ShardedLoader",
    "StepLog",
    "compile",
    "data_loader",
    "format_plan",
    "plan",
    "search_plans",
]
