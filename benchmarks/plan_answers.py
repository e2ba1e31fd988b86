"""Every candidate's prediction in five searches, as JSON: to compare the planner's answers across commits.

    python benchmarks/plan_answers.py OUT.json           # at one commit (or PYTHONPATH=<worktree> for another)
    python -c "import json,sys; print(json.load(open(sys.argv[1])) == json.load(open(sys.argv[2])))" A.json B.json

Searches: Llama-2-7B full fine-tune on 1 and 8 MI210 (seq 4096), Llama-2-70B on 8 MI300X, the README's 7B LoRA on
one MI210 (seq 2048), Llama-3-8B LoRA on one A100-80G. Per candidate: peak bytes, whether it fits, host peak, peak
phase, the per-phase breakdown, reserved bytes and modelled step time. Traces go to an empty temporary cache.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ["MEMFIT_TRACE_CACHE"] = tempfile.mkdtemp(prefix="memfit-plan-answers-")

from memfit.config.schema import LoraConfig  # noqa: E402
from memfit.models.planning import config_for_planning  # noqa: E402
from memfit.planner.hardware import gpu_preset  # noqa: E402
from memfit.planner.search import Cluster, Workload, search  # noqa: E402

CASES = [
    ("llama2-7b", 4096, 16, "mi210", 1, False),
    ("llama2-7b", 4096, 64, "mi210", 8, False),
    ("llama2-70b", 4096, 64, "mi300x", 8, False),
    ("llama2-7b", 2048, 16, "mi210", 1, True),
    ("llama3-8b", 2048, 8, "a100-80g", 1, True),
]


def main() -> None:
    out = {}
    for model, seq, batch, gpu, n, lora in CASES:
        w = Workload(config_for_planning(model), model, seq, batch, lora=LoraConfig() if lora else None)
        r = search(w, Cluster(gpu_preset(gpu), n))
        out[f"{model}-{seq}-{batch}-{gpu}x{n}-{'lora' if lora else 'full'}"] = {
            str(c.strategy.as_dict()): [
                c.memory.peak_bytes,
                c.fits,
                c.memory.host_peak_bytes,
                c.memory.peak_phase,
                {p: b.as_dict() for p, b in c.memory.phase_peaks.items()},
                c.reserved_bytes,
                c.step_time_s,
            ]
            for c in r.fitting + r.pruned
        }
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh)
    print(f"{sum(len(v) for v in out.values())} candidates in {len(out)} searches -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
