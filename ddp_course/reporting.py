"""Plain-text tables and scaling plots for measurement labs."""

from __future__ import annotations


def format_table(records: list[dict], columns: list[str]) -> str:
    """Records as an aligned text table; floats get 4 significant digits, missing values '-'."""

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    rows = [columns] + [[cell(record.get(column)) for column in columns] for record in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(text.rjust(width) for text, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def plot_scaling(records: list[dict], path: str) -> None:
    """Throughput against world size per configuration (with the ideal line), and comm fraction."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works on machines without a display
    import matplotlib.pyplot as plt

    fig, (throughput_axes, comm_axes) = plt.subplots(1, 2, figsize=(10, 4))
    # A bucket cap is a size in MiB or the string "default" (DDP's own bucketing): keep the records'
    # order rather than sorting values of two types.
    series = list(dict.fromkeys((r["config"], r["bucket_cap_mb"]) for r in records))
    for config, bucket_cap in series:
        points = sorted(((r["world_size"], r) for r in records if (r["config"], r["bucket_cap_mb"]) == (config, bucket_cap)), key=lambda point: point[0])
        sizes = [size for size, _ in points]
        label = config if len({cap for _, cap in series}) == 1 else f"{config}, {_bucket_label(bucket_cap)}"
        line = throughput_axes.plot(sizes, [r["samples_per_s"] for _, r in points], "o-", label=label)[0]
        if sizes[0] == 1:  # ideal: N times one rank's throughput
            throughput_axes.plot(sizes, [s * points[0][1]["samples_per_s"] for s in sizes], ":", color=line.get_color())
        comm_axes.plot(sizes, [r["comm_fraction"] for _, r in points], "o-", color=line.get_color(), label=label)
    throughput_axes.set(xlabel="ranks (world size)", ylabel="samples / s (dotted: ideal)", title="Throughput")
    comm_axes.set(xlabel="ranks (world size)", ylabel="1 - t(no_sync) / t(DDP)", title="Communication fraction", ylim=(0, 1))
    for axes in (throughput_axes, comm_axes):
        axes.set_xticks(sorted({r["world_size"] for r in records}))
        axes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bucket_label(bucket_cap) -> str:
    return "default buckets" if isinstance(bucket_cap, str) else f"{bucket_cap:g} MiB buckets"
