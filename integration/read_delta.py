"""Reads a Delta table with the Python `deltalake` package (delta-rs's Python binding, an
independent reader of the table format) and prints its schema and rows as JSON on stdout.

Usage: python3 read_delta.py TABLE_PATH_OR_URL
Storage options for an object-store URL (JSON object) come from DELTA_STORAGE_OPTIONS.
Output: {"schema": [[name, type], ...], "rows": [{col: value, ...}, ...], "version": N}
"""
import json
import os
import sys

from deltalake import DeltaTable


def plain(value):
    """JSON for values json cannot encode: bytes as text, timestamps in RFC 3339."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def main() -> None:
    options = json.loads(os.environ.get("DELTA_STORAGE_OPTIONS", "{}"))
    table = DeltaTable(sys.argv[1], storage_options=options or None)
    data = table.to_pyarrow_table()
    schema = [[f.name, str(f.type)] for f in data.schema]
    rows = data.to_pylist()
    out = {"schema": schema, "rows": rows, "version": table.version()}
    json.dump(out, sys.stdout, default=plain)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # Skip interpreter shutdown: deltalake/pyarrow background threads can abort the process
    # while it finalises ("terminate called without an active exception", delta-rs#2184,
    # arrow#34314) after the read has completed and been printed.
    os._exit(0)
