"""``kvtool codecs``: which codecs exist here and how they run."""

from __future__ import annotations

import typer

from kvtool.cli._common import JSON_OPTION, Command, print_json, print_table
from kvtool.codecs import registry
from kvtool.errors import KvtoolError


def codec_report() -> list[dict]:
    rows = []
    for id_ in registry.ids():
        try:
            cls = registry.get(id_)
            avail = cls.available()
            row = {"id": id_, "available": avail.ok, "implementation": avail.implementation, "reason": avail.reason}
            row.update(getattr(cls, "details", dict)())
        except KvtoolError as exc:
            row = {"id": id_, "available": False, "implementation": "", "reason": str(exc)}
        rows.append(row)
    return rows


def codecs(json_out: bool = JSON_OPTION):
    """List every registered codec: available or why not, and the implementation it runs on."""
    rows = codec_report()
    if json_out:
        print_json(rows)
        return
    for row in rows:
        row["status"] = "available" if row["available"] else "unavailable"
        row["runs on (or why not)"] = row["implementation"] if row["available"] else row["reason"]
        if "gpu" in row:  # a codec with a GPU decoder says whether it runs here
            row["runs on (or why not)"] += f"; GPU decode: {row['gpu_implementation'] or 'unavailable, ' + row['gpu_reason']}"
    print_table(rows, ["id", "status", "runs on (or why not)"])


def register(app: typer.Typer) -> None:
    app.command("codecs", cls=Command)(codecs)
