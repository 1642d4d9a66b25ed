#!/usr/bin/env python3
"""PNG plots from perf/torch_baselines.py JSON: speed (fraction of the dense ceiling) and
activation memory per config, for MoEBlaze, torch._grouped_mm and naive PyTorch.

Usage: python3 perf/plot_results.py perf/results/torch_baselines.json perf/results/
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src, out_dir = sys.argv[1], sys.argv[2]
    rows = json.load(open(src))
    impls = ["moeblaze", "grouped_mm", "naive"]
    colors = {"moeblaze": "#d62728", "grouped_mm": "#1f77b4", "naive": "#7f7f7f"}
    for act in ("silu", "swiglu"):
        sel = [r for r in rows if r["activation"] == act]
        configs = sorted({r["config"] for r in sel})
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        width = 0.27
        for i, impl in enumerate(impls):
            vals = {r["config"]: r for r in sel if r["impl"] == impl}
            xs = [c_i + (i - 1) * width for c_i in range(len(configs))]
            axes[0].bar(xs, [100 * vals[c]["dense_ratio"] if c in vals else 0 for c in configs], width,
                        label=impl, color=colors[impl])
            axes[1].bar(xs, [vals[c]["activation_bytes"] / 2**20 if c in vals else 0 for c in configs], width,
                        label=impl, color=colors[impl])
        for ax in axes:
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels(configs)
            ax.legend()
            ax.grid(axis="y", alpha=0.3)
        axes[0].set_ylabel("fwd+bwd, % of dense bf16 GEMM rate (same run)")
        axes[1].set_ylabel("activation memory saved for backward, MiB")
        fig.suptitle("One MoE layer, bf16, H100: %s" % act)
        fig.tight_layout()
        path = os.path.join(out_dir, "moe_%s.png" % act)
        fig.savefig(path, dpi=110)
        print(path)


if __name__ == "__main__":
    main()
