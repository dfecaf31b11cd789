"""Plans handed to the engines teams already run: one function per engine, plan -> files.

Each returns an ``Export`` (its files, and what of the plan the engine cannot express as
warnings, also written in the files' header); ``Export.write(dir)`` writes the files
atomically, scripts executable. ``plan_from_megatron`` and ``plan_from_torchtitan`` read an
existing Megatron-LM or torchtitan job's arguments back into a plan, to be priced next to
autopar's own.
"""

from autopar.exports.accelerate import export_accelerate
from autopar.exports.common import Export, ExportFile
from autopar.exports.deepspeed import export_deepspeed
from autopar.exports.megatron import export_megatron
from autopar.exports.torchtitan import export_torchtitan

EXPORTERS = {"megatron": export_megatron, "deepspeed": export_deepspeed,
             "accelerate": export_accelerate, "torchtitan": export_torchtitan}
"""Engine name -> its export function (``plan, plan_path, **launch`` -> ``Export``)."""

__all__ = ["EXPORTERS", "Export", "ExportFile", "export_accelerate", "export_deepspeed",
           "export_megatron", "export_torchtitan"]
