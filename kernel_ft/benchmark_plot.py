"""Redraw the figure of a benchmark_kernels.py run from its JSON (measures nothing).

One row of panels per kernel, fwd on the left and fwd+bwd on the right: for every
shape a group of bars, one per provider, of effective bandwidth (GB/s; TFLOP/s for
the matmul-bound linear + cross-entropy). A provider has the same color in every
panel; the dashed line is the device copy bandwidth of that run. Where a provider
has no bar, the reason is written in its place (OOM, ERR, not installed, n/a (CPU)).
The title quotes the GPU, the versions and the date from the JSON.

It reads the JSON of today's benchmark and of earlier runs (results/bench_h200.json
predates the "rate_unit" and "flops" keys: such a file is all bandwidth).

Usage:
    python -m kernel_ft.benchmark_plot results/bench_h100.json --out results/bench_h100.png
"""

import argparse
import json
import os

PASSES = (("fwd", "fwd"), ("fwdbwd", "fwd+bwd"))
# One color (a tab10 index) per kind of provider, whatever the kernel: "ours (Triton)"
# and "ours (Triton + cuBLAS)" are both ours; "Liger-Kernel FLCE" is Liger.
PALETTE = {"ours (Triton": 0, "ours (in-place)": 9, "PyTorch eager": 1, "F.": 2, "torch.compile": 3,
           "Liger-Kernel": 4, "Apple cut-cross-entropy": 5}


def rate(rec, p):
    """The bar of one record: TFLOP/s for matmul-bound work, else effective GB/s."""
    return rec.get(f"{p}_TFLOPs") if rec.get("flops") else rec.get(f"{p}_GBps")


def color_index(provider, others):
    for prefix, index in PALETTE.items():
        if provider.startswith(prefix):
            return index
    return 6 + others.index(provider) % 3  # a provider this list does not know yet


def plot_results(results, path, metadata=None):
    """Draw ``results`` (the dict benchmark_kernels.main() returns, or its JSON) to ``path``.
    ``metadata``: the PNG's text fields (the callers pass files.PNG_METADATA, the
    project's mark that lets a later run replace the file)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    kernels = list(results["kernels"].values())
    env = results["environment"]
    copy_bw = env.get("copy_bandwidth_GBps")
    unknown = [p for k in kernels for p in k["providers"] if not any(p.startswith(x) for x in PALETTE)]
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(kernels), 2, figsize=(15, 4.8 * len(kernels)), squeeze=False)
    for row, kres in enumerate(kernels):
        labels = list(dict.fromkeys(r["label"] for r in kres["results"]))  # shapes, in run order
        lookup = {(r["label"], r["provider"]): r for r in kres["results"]}
        providers = kres["providers"]
        width = 0.8 / max(len(providers), 1)
        unit = kres.get("rate_unit", "GB/s")
        copy_line = copy_bw if unit == "GB/s" else None  # a bandwidth line only on bandwidth panels
        for col, (p, pass_label) in enumerate(PASSES):
            ax = axes[row][col]
            top = max([copy_line or 0.0] + [rate(r, p) or 0.0 for r in kres["results"]])
            drawn = False
            for k, provider in enumerate(providers):
                xs, ys = [], []
                for i, label in enumerate(labels):
                    rec, x = lookup.get((label, provider)), i - 0.4 + width * (k + 0.5)
                    if rec and rate(rec, p):
                        xs.append(x)
                        ys.append(rate(rec, p))
                    elif rec and top > 0:  # no bar: say why (OOM, ERR, not installed, ...)
                        ax.text(x, top * 0.02, str(rec.get(f"{p}_status")), rotation=90, ha="center",
                                va="bottom", fontsize=7, color="dimgray")
                ax.bar(xs, ys, width, label=provider, color=cmap(color_index(provider, unknown)))
                drawn = drawn or bool(ys)
            if copy_line:
                ax.axhline(copy_line, color="black", linestyle="--", linewidth=1,
                           label=f"device copy {copy_line:,.0f} GB/s")
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels)
            ax.set_xlabel("tokens")
            ax.set_ylabel("effective bandwidth (GB/s)" if unit == "GB/s" else unit)
            ax.set_title(f"{kres['title']} {pass_label}")
            if drawn:
                ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
                ax.legend(fontsize=7, loc="upper left", ncol=2)
            else:
                ax.set_yticks([])
                ax.text(0.5, 0.5, "no timings (CPU / Triton interpreter run)", transform=ax.transAxes,
                        ha="center", va="center", fontsize=11, color="dimgray")
    fig.suptitle(f"{env.get('gpu')} | torch {env.get('torch')} | triton {env.get('triton')} | "
                 f"transformers {env.get('transformers')} | {env.get('date')} -- higher is better")
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # leave the top strip to the title
    fig.savefig(path, dpi=120, metadata=metadata)
    plt.close(fig)


def load_results(path):
    """The benchmark JSON at ``path``, or one line that says what is wrong with it."""
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path}: not a readable JSON file ({exc})") from None
    if not isinstance(results, dict) or not results.get("kernels") or "environment" not in results:
        raise SystemExit(f"error: {path}: not a benchmark_kernels.py JSON (no 'kernels' or 'environment')")
    return results


def main(argv=None):
    # Imported here, not above: plot_results alone (what benchmark_kernels.py calls)
    # needs nothing from the repository, and flags loads torch and transformers.
    from kernel_ft.files import PNG_METADATA, check_input_file, check_output_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="a JSON written by benchmark_kernels.py --json")
    parser.add_argument("--out", required=True, metavar="PATH.png", help="where to draw the figure")
    args = parser.parse_args(argv)
    source = check_input_file(args.json, "JSON")
    out = check_output_path(args.out, "--out", inputs=[("JSON", os.path.realpath(source))], suffix=".png")
    try:
        plot_results(load_results(source), out, metadata=PNG_METADATA)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # the right keys, the wrong contents
        raise SystemExit(f"error: {source}: not the JSON benchmark_kernels.py writes "
                         f"({type(e).__name__}: {e})") from None
    print(f"Wrote {out} from {source}")


if __name__ == "__main__":
    main()
