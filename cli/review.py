"""`meshlm review`: the web page and JSON API over a review queue (align/curate/review_db.py).

  meshlm review --db PATH [--create] [--host 127.0.0.1] [--port 8765] [--lease_s 600]
  meshlm review --db PATH --export ROOT     (write ROOT/review_results/vK + report.json, exit)
  meshlm review --db PATH --report          (print the audit report as JSON, exit)

The page and its API: align/curate/review_server.py.
"""

import json
import os

from absl import flags

from align.curate.review_db import ReviewQueue
from align.curate.review_server import serve
from cli.parsing import UsageError, parse, require


def make_flags(argv: list[str]) -> flags.FlagValues:
  del argv  # no --config here
  fv = flags.FlagValues()
  flags.DEFINE_string("db", None, "review queue SQLite file", flag_values=fv)
  flags.DEFINE_bool("create", False, "create --db if it does not exist (else a missing file "
                    "is an error: a mistyped path must not open an empty queue)", flag_values=fv)
  flags.DEFINE_string("host", "127.0.0.1", "address to listen on", flag_values=fv)
  flags.DEFINE_integer("port", 8765, "port to listen on (0: any free one)", flag_values=fv)
  flags.DEFINE_float("lease_s", 600.0, "seconds a reviewer holds an item before others may "
                     "take it", flag_values=fv)
  flags.DEFINE_string("export", None, "write the resolved items as the asset "
                      "ROOT/review_results/vK (+ report.json) and exit", flag_values=fv)
  flags.DEFINE_bool("report", False, "print the audit report as JSON and exit", flag_values=fv)
  flags.DEFINE_bool("verbose", False, "log every request", flag_values=fv)
  return fv


def main(argv: list[str], command: str = "review") -> None:
  """`meshlm review ARGS`: argv is everything after `review`."""
  fv = make_flags(argv)
  parse(command, argv, fv, __doc__)
  require(command, fv, "db")
  if not 0 <= fv["port"].value < 65536:
    raise UsageError(f"meshlm {command}: --port={fv['port'].value} is not a port: use 0 (any "
                     "free one) to 65535")
  if not fv["create"].value and not os.path.exists(fv["db"].value):
    raise UsageError(f"meshlm {command}: --db {fv['db'].value} does not exist (--create makes "
                     "a new, empty queue)")
  try:
    queue = ReviewQueue(fv["db"].value, lease_s=fv["lease_s"].value)
    if fv["export"].value is not None:
      version_dir = queue.export(fv["export"].value)
      print(json.dumps({"asset": version_dir, **queue.progress()}))
      return
    if fv["report"].value:
      print(json.dumps(queue.report(), indent=2))
      return
    server = serve(queue, fv["host"].value, fv["port"].value, fv["verbose"].value)
  except (FileNotFoundError, ValueError, OSError) as e:
    raise SystemExit(f"meshlm {command}: error: {e}") from e
  host, port = server.server_address[:2]
  p = queue.progress()
  print(f"meshlm {command}: {fv['db'].value} ({p['resolved']} / {p['total']} resolved) at "
        f"http://{host}:{port}/", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
