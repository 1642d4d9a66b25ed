#!/usr/bin/env python3
"""Side-by-side table of two moeblaze-bench runs (the fused and the cuBLASLt engine, same configs).

Usage: perf/engines_table.py FUSED.md CUBLASLT.md [--configs perf/configs/modern-configs.json]

Reads the markdown rows that moeblaze-bench prints (`scripts/gpu-check.sh engines` keeps them as
engines-{paper,modern}-{fused,cublaslt}.md) and prints one row per (config, activation): each
cell "fused / cuBLASLt", the fused speed-up (cuBLASLt ms / fused ms) and, with --configs naming
SonicMoE's figures (modern-configs.json), the faster engine's TFLOP/s against SonicMoE's.
"""
import argparse
import json


def rows(path):
    """{(config, act): {column: text}} from a moeblaze-bench markdown table."""
    out, header = {}, None
    for line in open(path):
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "config":
            header = cells
        elif header and not cells[0].startswith("-"):
            out[(cells[0], cells[1])] = dict(zip(header, cells))
    return out


def numeric(text):
    try:
        float(text)
        return True
    except (TypeError, ValueError):
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fused")
    ap.add_argument("cublaslt")
    ap.add_argument("--configs", help="configs JSON with sonic_tflops / sonic_tflops_paper")
    a = ap.parse_args()
    f, c = rows(a.fused), rows(a.cublaslt)
    sonic = {}
    if a.configs:
        for cfg in json.load(open(a.configs))["configs"]:
            v = cfg.get("sonic_tflops", cfg.get("sonic_tflops_paper"))
            if v:
                sonic[cfg["name"]] = v
    cols = ["fwd ms", "bwd ms", "fwd+bwd ms", "TFLOP/s", "% of dense"]
    head = ["config", "act"] + cols + ["fused speed-up", "peak MiB"] + (["best vs SonicMoE"] if sonic else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key, fr in f.items():
        cr = c.get(key)
        if cr is None or not all(numeric(r.get(col)) for r in (fr, cr) for col in cols + ["peak MiB"]):
            continue  # a row one engine did not run (or could not time) is left out
        cells = list(key)
        for col in cols:
            fv, cv = float(fr[col]), float(cr[col])
            fmt = "{:.0f}" if col == "TFLOP/s" else "{:.1f}" if col == "% of dense" else "{:.3f}"
            cells.append(fmt.format(fv) + " / " + fmt.format(cv))
        cells.append("{:.2f}x".format(float(cr["fwd+bwd ms"]) / float(fr["fwd+bwd ms"])))
        cells.append("{:.0f} / {:.0f}".format(float(fr["peak MiB"]), float(cr["peak MiB"])))
        if sonic:
            s = sonic.get(key[0])
            best = max(float(fr["TFLOP/s"]), float(cr["TFLOP/s"]))
            cells.append("{:.0f} vs {}: {:.2f}x".format(best, s, best / s) if s else "")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
