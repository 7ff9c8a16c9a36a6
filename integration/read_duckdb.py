"""Reads a Delta table with DuckDB's `delta_scan` (the delta extension, on delta-kernel-rs: a
third independent reader) and prints its columns and rows as JSON on stdout.

Usage: python3 read_duckdb.py TABLE_PATH_OR_URL
For an s3:// URL, DELTA_STORAGE_OPTIONS (JSON object) gives AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION. The extensions come from the PyPI
wheels duckdb-ext-delta and duckdb-ext-httpfs (installed by ./test), so nothing is downloaded.
Output: {"schema": [[name, type], ...], "rows": [{col: value, ...}, ...]}
"""
import json
import os
import sys
import sysconfig
from urllib.parse import urlparse

import duckdb


def plain(value):
    """JSON for values json cannot encode: timestamps and dates in ISO 8601."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def main() -> None:
    table = sys.argv[1]
    extensions = os.path.join(sysconfig.get_paths()["purelib"], "duckdb_ext", "extensions")
    con = duckdb.connect(
        config={"extension_directory": extensions, "autoinstall_known_extensions": False}
    )
    con.execute("LOAD httpfs")
    con.execute("LOAD delta")
    options = json.loads(os.environ.get("DELTA_STORAGE_OPTIONS", "{}"))
    if table.startswith("s3://"):
        endpoint = urlparse(options["AWS_ENDPOINT_URL"])
        def quoted(text):
            return "'" + str(text).replace("'", "''") + "'"

        con.execute(
            "CREATE SECRET s3 (TYPE s3, KEY_ID {}, SECRET {}, REGION {}, ENDPOINT {}, "
            "URL_STYLE 'path', USE_SSL {})".format(
                quoted(options["AWS_ACCESS_KEY_ID"]),
                quoted(options["AWS_SECRET_ACCESS_KEY"]),
                quoted(options.get("AWS_REGION", "us-east-1")),
                quoted(endpoint.netloc),
                "true" if endpoint.scheme == "https" else "false",
            )
        )
    # Through Arrow: DuckDB's own Python conversion of timestamps with a zone needs pytz.
    data = con.execute("SELECT * FROM delta_scan(?)", [table]).arrow()
    data = data.read_all() if hasattr(data, "read_all") else data
    schema = [[f.name, str(f.type)] for f in data.schema]
    json.dump({"schema": schema, "rows": data.to_pylist()}, sys.stdout, default=plain)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
