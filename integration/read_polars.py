"""Reads a Delta table with Polars (`polars.read_delta`, a second independent reader) and prints
its columns, dtypes and rows as JSON on stdout.

Usage: python3 read_polars.py TABLE_PATH_OR_URL
Storage options for an object-store URL (JSON object) come from DELTA_STORAGE_OPTIONS.
Output: {"schema": [[name, dtype], ...], "rows": [{col: value, ...}, ...]}
"""
import json
import os
import sys

import polars


def plain(value):
    """JSON for values json cannot encode: timestamps in RFC 3339."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def main() -> None:
    options = json.loads(os.environ.get("DELTA_STORAGE_OPTIONS", "{}"))
    frame = polars.read_delta(sys.argv[1], storage_options=options or None)
    schema = [[name, str(dtype)] for name, dtype in frame.schema.items()]
    json.dump({"schema": schema, "rows": frame.to_dicts()}, sys.stdout, default=plain)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # As read_delta.py: skip interpreter shutdown (background threads of the readers).
    os._exit(0)
