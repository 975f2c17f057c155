"""One line per start of an `hf-accel bench --workload startup` JSON: total, phases, trace source, capture split.

    python examples/startup_summary.py startup-llama-3.1-8b.json
"""

import json
import sys


def main(path: str) -> None:
    data = json.load(open(path))["startup"]
    name = path.rsplit("/", 1)[-1]
    for phase in ("cold", "warm"):
        rec = data.get(phase) or {}
        s = rec.get("engine_startup") or {}
        if not s:
            print(name, phase, "no figure:", rec.get("reasons"), (rec.get("stderr_tail") or "")[-600:])
            continue
        build = ((rec.get("engine_info") or {}).get("small_m_gemm") or {}).get("build") or {}
        print(name, phase, f"total {rec.get('total_s', -1):.1f} s",
              {k: round(v, 2) for k, v in (s.get("phases") or {}).items()}, s.get("trace_source"),
              {k: round(v, 2) for k, v in (s.get("capture_split") or {}).items()},
              "small-M build ahead:", {k: round(v, 2) if isinstance(v, float) else v for k, v in build.items()},
              "capture build ahead:", {k: round(v, 2) if isinstance(v, float) else v
                                       for k, v in (s.get("capture_build_ahead") or {}).items()},
              "Triton kernels built:", rec.get("triton_kernels_built", "?"))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        main(arg)
