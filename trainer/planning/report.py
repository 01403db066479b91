"""Markdown report and PNG plot of a ``probe`` result (the dict written to ``probe.json``)."""

from __future__ import annotations

from pathlib import Path

GIB = 1024**3


def render_markdown(r: dict) -> str:
    """Markdown report: limit and method, the batch-size table, the loader table, the data verdict."""
    cfg = r["config"]
    lines = [
        f"# Probe: {cfg['model']} at {r['image_size']} px on {r['device_name']}",
        "",
        f"- precision `{cfg['precision']}` -> {r['precision']}, optimizer `{cfg['optimizer']}`, EMA {cfg['use_ema']}, "
        f"accumulate {cfg['accumulate_grad_batches']}",
        f"- memory limit {r['limit_bytes'] / GIB:.3f} GiB ({r['limit_source']}), safety margin "
        f"{r['margin']:.0%}; memory measured with {r['memory_method']}",
        f"- **largest batch per device that fits with the margin: {r['best_batch']}**"
        + (f" ({r['best_images_per_s']:.1f} images/s)" if r["best_images_per_s"] else ""),
        f"- probe took {r['seconds']:.1f} s",
        "",
        "| batch | peak memory (GiB) | reserved (GiB) | step (s) | images/s | result |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for m in r["measurements"]:
        result = "OOM" if m["oom"] else ("fits" if m["fits"] else "over the margin")
        lines.append(
            f"| {m['batch']} | {m['peak_bytes'] / GIB:.3f} | {m['reserved_bytes'] / GIB:.3f} | "
            f"{m['step_s']:.3f} | {m['images_per_s']:.1f} | {result} {m['note']} |"
        )
    lines += [
        "",
        "Order above = order measured (doubling, then bisection after the first failure).",
        "",
        "## Loader",
        "",
        "| num_workers | prefetch_factor | images/s | first batch (s) | workers private RAM (GiB) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in r["loader"]:
        lines.append(
            f"| {x['num_workers']} | {x['prefetch_factor']} | {x['images_per_s']:.0f} | "
            f"{x['first_batch_s']:.2f} | {x['workers_private_bytes'] / GIB:.3f} |"
        )
    ram = r.get("loader_ram_prediction")
    if ram:
        lines += [
            "",
            f"Loader host RAM per rank at the config's num_workers={ram['num_workers']}, "
            f"prefetch_factor={ram['prefetch_factor']}, batch {ram['micro_batch']}: "
            f"{ram['batches_in_flight']} batches x {ram['micro_batch']} x {ram['bytes_per_sample']} B "
            f"({ram['bytes_per_sample_source']}) + {ram['num_workers']} x "
            f"{ram['worker_overhead_bytes'] / 2**20:.0f} MiB ({ram['worker_overhead_source']}) "
            + (
                f"+ the workers' fork server {ram['worker_server_bytes'] / 2**20:.0f} MiB "
                if ram["num_workers"]
                else ""
            )
            + f"= **{ram['total_bytes'] / GIB:.3f} GiB**",
        ]
    if r.get("host_rss_hwm_bytes"):
        lines += [
            "",
            f"Host RAM of this process (VmHWM after the batch search): {r['host_rss_hwm_bytes'] / GIB:.3f} GiB, of "
            f"which the dataset it holds: {r.get('host_data_bytes_per_process', 0) / GIB:.3f} GiB "
            f"(`plan --jobs-per-instance` uses the difference on {r['device_name']})",
        ]
    if r.get("data_verdict"):
        lines += ["", f"Data: {r['data_verdict']}."]
    return "\n".join(lines) + "\n"


def render_plot(r: dict, path: Path) -> Path:
    """Two panels: peak memory vs batch (limit and margin lines, failures marked) and loader images/s vs workers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ms = sorted(r["measurements"], key=lambda m: m["batch"])
    ok = [m for m in ms if not m["oom"]]
    a.plot([m["batch"] for m in ok], [m["peak_bytes"] / GIB for m in ok], "o-", label="measured peak")
    for m in ms:
        if m["oom"]:
            a.axvline(m["batch"], color="tab:red", linestyle=":", label=f"OOM at {m['batch']}")
    a.axhline(r["limit_bytes"] / GIB, color="tab:red", label="limit")
    a.axhline(r["limit_bytes"] * (1 - r["margin"]) / GIB, color="tab:orange", linestyle="--", label="limit - margin")
    a.set_xscale("log", base=2)
    a.set_xlabel("batch per device (images)")
    a.set_ylabel("GiB")
    a.set_title(f"{r['config']['model']} {r['image_size']} px, best batch {r['best_batch']}")
    a.legend(fontsize=7)
    for p in sorted({x["prefetch_factor"] for x in r["loader"]}):
        rows = sorted(
            (x for x in r["loader"] if x["prefetch_factor"] == p or x["num_workers"] == 0),
            key=lambda x: x["num_workers"],
        )
        b.plot([x["num_workers"] for x in rows], [x["images_per_s"] for x in rows], "o-", label=f"prefetch {p}")
    if r.get("best_images_per_s"):
        b.axhline(r["best_images_per_s"], color="tab:green", linestyle="--", label="step images/s at best batch")
    b.set_xlabel("num_workers")
    b.set_ylabel("images/s")
    b.set_title("loader")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)
