"""Report output: ratios (finalize), the at-a-glance table, and the bar chart."""

from __future__ import annotations

from typing import Any

from .workloads import GIB


def finalize(report: dict[str, Any]) -> None:
    """Ratios ours/anchor and ours/roofline, from valid figures only; threads against W2 of the same run."""
    workloads = report["workloads"]
    if "threads" in workloads:  # WORKLOADS.md: N threads' generate() against one batch-N W2 call, both ours
        threads = workloads["threads"]["methods"].get("ours", {}).get("median_tokens_per_s")
        w2 = workloads.get("w2", {}).get("methods", {}).get("ours", {}).get("median_tokens_per_s")
        workloads["threads"]["threads_vs_w2"] = threads / w2 if threads and w2 else None
    for entry in workloads.values():
        methods = entry["methods"]
        ours = methods.get("ours", {}).get("median_tokens_per_s")
        entry["ratios"] = {}
        for name, rec in methods.items():
            if name == "ours":
                continue
            theirs = rec.get("median_tokens_per_s")
            entry["ratios"][f"ours/{name}"] = ours / theirs if ours and theirs else None
        roof = entry.get("roofline_tokens_per_s")
        entry["roofline_ratio"] = {name: (rec.get("median_tokens_per_s") / roof
                                          if roof and rec.get("median_tokens_per_s") else None)
                                   for name, rec in methods.items()}


# ------------------------------------------------------------------------------------------------------ output
def _num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:,.{digits}f}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:  # two text columns left-aligned, figures right-aligned
        return "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def format_report(report: dict[str, Any]) -> str:
    """The at-a-glance table: per workload ours, each anchor, ratios, roofline and target; then startup."""
    env, model, accel = report["env"], report["model"], report.get("accel", {})
    info = accel.get("engine_info") or {}
    gpu = env.get("gpu_name")
    head = [f"hf-accel bench  {model.get('name')}  {model.get('dtype')}  on {env.get('device')}"
            + (f" ({gpu})" if gpu else "") + f"  scale={report.get('scale')}"]
    v = env.get("versions", {})
    head.append("versions: " + "  ".join(f"{k} {v.get(k)}" for k in ("torch", "transformers", "triton", "flashinfer",
                                                                       "flash-attn")))
    if info:
        head.append(f"engine: backend={info.get('attention_backend')}  graphs={info.get('cudagraph_mode')}  "
                    f"compile={info.get('compile')}  block_size={info.get('block_size')}  "
                    f"kv_blocks={info.get('num_kv_blocks')}")
        fallbacks = info.get("fallbacks") or {}
        if fallbacks:
            head.append("fallbacks: " + "; ".join(f"{k}: {v}" for k, v in fallbacks.items())[:300])
    wbytes = model.get("weight_bytes")
    if wbytes:  # what quantization saves goes to the KV pool: weights and KV blocks side by side
        kv = info.get("kv_cache_bytes")
        head.append(f"memory: weights {wbytes / GIB:.2f} GiB ({model.get('quantization') or 'none'})"
                    + (f"; KV pool {info.get('num_kv_blocks')} blocks = {kv / GIB:.2f} GiB" if kv else ""))
    if info:
        tune = info.get("backend_autotune")
        if tune and tune.get("timings"):
            scores = ", ".join(f"{k} {v['score']:.3f}" if "score" in v else f"{k} not timed" if "skipped" in v
                               else f"{k} failed" for k, v in tune["timings"].items())
            how = ("remembered from an earlier start's timing of" if tune.get("cached")
                   else f"timed in {tune.get('seconds', 0):.1f} s:")
            head.append(f"attention 'auto': {how} {tune.get('candidates')}, chose {tune.get('chosen')} (static "
                        f"order: {tune.get('static_choice')}); score = 4 x decode ms + prefill ms: {scores}")
        elif tune and tune.get("error"):
            head.append(f"attention 'auto': autotune failed ({tune['error']}), static choice {tune.get('chosen')}")
    bw = env.get("copy_bandwidth_bytes_per_s")
    if bw:
        head.append(f"device copy bandwidth: {bw / 1e12:.2f} TB/s; 'of bandwidth' = bytes moved per step (weights + "
                    "KV read + KV written) / step time, as a fraction of it (the HBM roofline row is 100 %)")
    guard = report.get("guard")
    if guard is not None:
        if guard.get("ran") is False:
            head.append("correctness guard: not run (accelerate_model failed, see notes) -> no valid figure of ours")
        elif guard.get("passed"):
            n = sum(c["requests"] for c in guard.get("cases", {}).values())
            ties = guard.get("near_ties", 0)
            head.append(f"correctness guard: PASS ({n} requests in {len(guard.get('cases', {}))} batch shapes, "
                        + ("token-for-token equal to the eager torch backend)" if not ties else
                           f"equal to the eager torch backend but for {ties} rounding near-tie(s)"
                           + (f", {guard['within_stock_self_noise']} row(s) of them beyond the dtype's rounding but "
                              f"within stock's own spread on the same rows (stock's own tokens up to "
                              f"{guard['stock_self_noise']:.3g} logits beyond it; "
                              f"{', '.join(guard.get('stock_self_noise_sources') or ['decoding vs scoring'])})"
                              if guard.get("within_stock_self_noise") else "")
                           + f": {guard.get('tie_rule')})"))
        else:
            bad = [_failed_guard_case(k, c) for k, c in guard.get("cases", {}).items()
                   if not c.get("ok", c.get("equal"))]
            why = guard.get("error") or "tokens differ: " + "; ".join(bad)
            head.append(f"correctness guard: FAIL ({why}) -> our speed figures are INVALID")
    out = ["\n".join(head)]

    if report["workloads"]:
        rows = []
        for entry in report["workloads"].values():
            spec = entry["spec"]
            title = f"{spec['title']}"
            sub = (f"{spec['num_requests']} x {spec['prompt']} -> {spec['new_tokens']}")
            target = entry.get("target_tokens_per_s")
            ours_ok = entry["methods"].get("ours", {}).get("median_tokens_per_s")
            for i, (name, rec) in enumerate(entry["methods"].items()):
                n = len(rec.get("run_s", []))
                if rec.get("valid") and rec.get("median_tokens_per_s") is not None:
                    fig = _num(rec["median_tokens_per_s"])
                else:
                    fig = "INVALID"
                ratio = "" if name == "ours" else (
                    f"{entry['ratios'].get(f'ours/{name}'):.2f}x" if entry["ratios"].get(f"ours/{name}") else "-")
                roof = entry.get("roofline_ratio", {}).get(name)
                tgt = ""
                if name == "ours" and target:
                    tgt = f">= {_num(target)} " + ("met" if ours_ok and ours_ok >= target else "NOT met")
                peak = rec.get("peak_memory_bytes")
                rows.append([title if i == 0 else (sub if i == 1 else ""), rec.get("label", name),
                             f"{fig}", f"{n}", ratio, f"{roof:.1%}" if roof else "",
                             f"{peak / GIB:.1f}" if peak else "", tgt])
            if len(entry["methods"]) == 1:
                rows.append([sub, "", "", "", "", "", "", ""])
            if entry.get("roofline_tokens_per_s"):
                rows.append(["", "HBM roofline", _num(entry["roofline_tokens_per_s"]), "", "", "", "", ""])
            if "threads_vs_w2" in entry:
                ratio, goal = entry["threads_vs_w2"], entry.get("target_threads_vs_w2")
                verdict = (f">= {goal:.0%} of W2 " + ("met" if ratio is not None and ratio >= goal else "NOT met")
                           if goal else "")
                rows.append(["", "threads / one W2 call (both ours)",
                             f"{ratio:.1%}" if ratio is not None else "- (needs w2)", "", "", "", "", verdict])
        out.append(_table(rows, ["workload", "method", "tokens/s (median)", "runs", "ours/this", "of bandwidth",
                                 "peak GiB", "target"]))
        notes = []
        for w, entry in report["workloads"].items():
            for name, rec in entry["methods"].items():
                if not rec.get("valid"):
                    notes.append(f"  {w} {rec.get('label', name)}: INVALID: " + "; ".join(rec.get("reasons", []))[:300])
            if entry.get("anchors_note"):
                notes.append(f"  {w}: {entry['anchors_note']}")
            agree = entry.get("agreement_with_stock")
            if agree:
                notes.append(f"  {w}: ours vs stock (info only, low-precision ties may flip): "
                             f"{agree['rows_equal']}/{agree['rows']} rows equal, mean common prefix "
                             f"{agree['mean_common_prefix']:.1f}/"
                             f"{agree['tokens_per_row']} tokens")
        if notes:
            out.append("notes:\n" + "\n".join(notes))

    st = report.get("startup")
    if st:
        rows = []
        tgt = report.get("targets") or {}
        for phase in ("cold", "warm"):
            rec = st.get(phase) or {}
            es = rec.get("engine_startup") or {}
            cc = rec.get("compile_cache") or {}
            if not rec.get("valid"):
                rows.append([phase, "INVALID: " + "; ".join(rec.get("reasons", []))[:200], *[""] * 9])
                continue
            limit = tgt.get(f"startup_{phase}_s")
            total = rec.get("total_s")
            verdict = (f"<= {limit:.0f} s " + ("met" if total is not None and total <= limit else "NOT met")
                       if limit else "")
            pool = rec.get("graph_pool_bytes")
            if tgt.get("graph_pool_bytes") and isinstance(pool, int | float):
                verdict += f"  pool <= 1 GiB {'met' if pool <= tgt['graph_pool_bytes'] else 'NOT met'}"
            if phase == "warm" and rec.get("triton_kernels_built"):
                verdict += f"  rebuilt {rec['triton_kernels_built']} Triton kernel(s)"
            warm = cc.get("warm")
            rows.append([phase, _num(es.get("patch_s"), 2), _num(es.get("autotune_s"), 2),
                         _num(es.get("kv_cache_s"), 2), _num(es.get("compile_s"), 2), _num(es.get("capture_s"), 2),
                         _num(rec.get("accelerate_s"), 2),
                         _num(rec.get("first_token_s"), 2), _num(total, 2),
                         f"{pool / GIB:.2f} GiB" if isinstance(pool, int | float) else "-",
                         (f"engine saw cache warm={warm}  " if warm is not None else "") + verdict])
        bytecode = (report.get("env") or {}).get("python_bytecode_cache")
        note = ("; no Python bytecode cache for torch here (PYTHONDONTWRITEBYTECODE and no .pyc files), so each "
                "start compiles the modules it imports from source" if bytecode is False else "")
        header = ["cache", "patch", "autotune", "kv cache", "compile", "capture", "accelerate_model", "first token",
                  "total", "graph pool", ""]
        out.append(f"startup (accelerate_model -> first token, {st.get('isolation')} isolation), seconds{note}\n"
                   + _table(rows, header))
    if report.get("w5"):
        out.append(format_w5(report["w5"]))
    return "\n\n".join(out)


def _failed_guard_case(name: str, case: dict[str, Any]) -> str:
    """One failed guard case for the report line: where it parted, how far stock leads our token, how far stock's
    own tokens stray there (when measured), and any error."""
    parts = [name]
    div = (case.get("agreement") or {}).get("first_divergence")
    if div:
        parts.append(f" at row {div['row']} step {div['step']}")
    leads = [d["worst_lead"] for d in case.get("divergences", []) if "worst_lead" in d]
    if leads:
        parts.append(f", stock lead over our token up to {max(leads):.3g}")
    spread = case.get("stock_self_spread")
    if spread:
        source = f", {spread['source']}" if spread.get("source") else ""
        parts.append(f" (stock's own tokens there{source}: {spread['stock_beyond_margin']} of "
                     f"{spread['stock_steps']} steps beyond the margin, by up to {spread['stock_max_excess']:.3g}; "
                     f"ours {spread['ours_beyond_margin']} of {spread['ours_steps']})")
    for error in (case.get("margin_error") or case.get("noise_error") or case.get("kernel_noise_error"),
                  case.get("ours_error") or case.get("reference_error")):
        if error:
            parts.append(f" ({error})")
    return "".join(parts)

def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def format_w5(w5: dict[str, Any]) -> str:
    """W5's table: per rate tokens/s, TTFT and TPOT; the offline twin and stock; the server/offline ratio."""
    spec = w5["spec"]
    lo, hi = spec["prompt_len_range"]
    mlo, mhi = spec["max_tokens_range"]
    head = (f"W5 serving: hf-accel serve, {spec['num_requests']} streamed requests, prompts U[{lo},{hi}], "
            f"max_tokens U[{mlo},{mhi}], openai client in this process")
    rows = []
    for key, entry in w5["rates"].items():
        med = entry.get("median") or {}
        ratio = w5["server_vs_offline_by_rate"].get(key)
        rows.append([("all at once" if key == "all" else f"{key} req/s"), "server",
                     _num(med.get("tokens_per_s")) if entry.get("valid") else "INVALID",
                     _ms(med.get("ttft_p50_s")), _ms(med.get("ttft_p99_s")), _ms(med.get("tpot_p50_s")),
                     _ms(med.get("tpot_p99_s")), str(len(entry.get("runs", []))),
                     f"{ratio:.1%}" if ratio else "-"])
    for name in ("offline", "stock"):
        rec = w5.get(name)
        if rec:
            fig = _num(rec.get("median_tokens_per_s")) if rec.get("median_tokens_per_s") else "INVALID"
            rows.append(["", rec.get("label", name), fig, "", "", "", "", str(len(rec.get("run_s", []))), ""])
    table = _table(rows, ["rate", "method", "tokens/s (median)", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                          "TPOT p99 ms", "runs", "of offline"])
    lines = [head, table]
    ratio, goal = w5.get("server_vs_offline"), w5.get("target_server_vs_offline")
    verdict = (f" (target >= {goal:.0%}: " + ("met" if ratio is not None and ratio >= goal else "NOT met") + ")"
               if goal else "")
    hr = w5.get("headline_rate")
    lines.append(f"server / offline at {'all at once' if hr == 'all' else hr + ' req/s'}: "
                 + (f"{ratio:.1%}" if ratio is not None else "-") + verdict)
    notes = []
    server = w5.get("server") or {}
    if server.get("startup_s") is not None:
        notes.append(f"server ready in {server['startup_s']:.1f} s")
    if server.get("not_forwarded"):
        notes.append(f"not passed to the server (nor to offline): {', '.join(server['not_forwarded'])}")
    if server.get("error"):
        notes.append(f"server: {server['error']}")
    cpu = [r.get("client_cpu_fraction") for e in w5["rates"].values() for r in e.get("runs", [])
           if r.get("client_cpu_fraction") is not None]
    if cpu and max(cpu) > 0.8:
        notes.append(f"the client used up to {max(cpu):.0%} of a CPU: it may limit the server figures")
    agree = w5.get("agreement_with_offline")
    if agree:
        notes.append(f"server vs offline tokens (info only, batch-dependent rounding may flip near-ties): "
                     f"{agree['rows_equal']}/{agree['rows']} requests equal")
    if not w5.get("valid"):
        notes.append("INVALID: " + "; ".join(w5.get("reasons", []))[:400])
    if notes:
        lines.append("notes:\n" + "\n".join(f"  {n}" for n in notes))
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    """Bar chart of tokens/s per workload and method (log scale); startup as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    has_startup = bool(report.get("startup"))
    ncols = max(1, len(workloads) + int(has_startup))
    fig, axes = plt.subplots(1, ncols, figsize=(4.5 * ncols, 4), squeeze=False)
    for ax, entry in zip(axes[0], workloads.values(), strict=False):
        names, vals = [], []
        for name, rec in entry["methods"].items():
            names.append(name + ("" if rec.get("median_tokens_per_s") else "\n(INVALID)"))
            vals.append(rec.get("median_tokens_per_s") or 0)
        bars = ax.bar(names, vals, color=["tab:green" if n == "ours" else "tab:gray" for n in entry["methods"]])
        ax.bar_label(bars, labels=[_num(v) if v else "" for v in vals], fontsize=8)
        if entry.get("roofline_tokens_per_s"):
            ax.axhline(entry["roofline_tokens_per_s"], color="tab:red", ls="--", label="HBM roofline")
            ax.legend()
        shown = [v for v in vals if v] + ([entry["roofline_tokens_per_s"]] if entry.get("roofline_tokens_per_s")
                                          else [])
        if shown and max(shown) / min(shown) > 20:  # anchors and ours can be orders of magnitude apart
            ax.set_yscale("log")
        ax.set_title(entry["spec"]["title"])
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", labelrotation=20)
    if has_startup:
        ax = axes[0][-1]
        parts = ("patch_s", "autotune_s", "kv_cache_s", "compile_s", "capture_s")
        bottoms = [0.0, 0.0]
        for part in (*parts, "first_token_s"):
            vals = []
            for phase in ("cold", "warm"):
                rec = report["startup"].get(phase) or {}
                es = rec.get("engine_startup") or {}
                vals.append(float(rec.get(part) if part == "first_token_s" else es.get(part) or 0) or 0.0)
            ax.bar(["cold", "warm"], vals, bottom=bottoms, label=part[:-2])
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        ax.set_title("startup")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    fig.suptitle(f"hf_accel bench: {report['model'].get('name')} on {report['env'].get('gpu_name') or 'cpu'}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


