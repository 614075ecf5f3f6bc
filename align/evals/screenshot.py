"""A full-page PNG of an HTML report, taken by Debian's headless Chromium through Playwright.

    python -m align.evals.screenshot REPORT.html OUT.png [--width 1200]

Needs the playwright package and Chromium (not Playwright's downloaded browsers):
  apt-get install -y chromium && pip install 'playwright>=1.60,<2'
MESHLM_CHROMIUM names another Chromium binary. The page gets no network: any request that
is not for the file itself or a data: URL is refused and reported, as are console errors,
so a report that is not self-contained shows up here.
"""

import argparse
import os
import struct
import sys

CHROMIUM = os.environ.get("MESHLM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
INSTALL = "apt-get install -y chromium && pip install 'playwright>=1.60,<2'"


def launch(p):
  """Chromium from `p` (a started sync_playwright()), or RuntimeError saying what is missing."""
  if not os.access(CHROMIUM, os.X_OK):
    raise RuntimeError(f"no Chromium at {CHROMIUM} (set MESHLM_CHROMIUM to another path); "
                       f"install with: {INSTALL}")
  return p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def sync_playwright():
  try:
    from playwright.sync_api import sync_playwright as start
  except ImportError as e:
    raise RuntimeError(f"the playwright package is not installed ({e}); install with: "
                       f"{INSTALL}") from e
  return start()


def png_size(path: str) -> tuple[int, int]:
  """(width, height) from a PNG's IHDR chunk."""
  with open(path, "rb") as f:
    head = f.read(24)
  if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
    raise ValueError(f"{path} is not a PNG file")
  return struct.unpack(">II", head[16:24])


def screenshot(html_path: str, png_path: str, width: int = 1200) -> dict:
  """Render `html_path` at `width` CSS pixels into a full-page `png_path` (written
  atomically). Returns the PNG's width and height, console errors and refused requests."""
  if not os.path.isfile(html_path):
    raise ValueError(f"no HTML file at {html_path}")
  if not isinstance(width, int) or not 200 <= width <= 10000:
    raise ValueError(f"width must be an int in [200, 10000], got {width!r}")
  url = "file://" + os.path.abspath(html_path)
  errors, refused = [], []

  def route(r):
    if r.request.url == url or r.request.url.startswith("data:"):
      r.continue_()
    else:
      refused.append(r.request.url)
      r.abort()
  tmp = png_path + ".tmp.png"
  with sync_playwright() as p:
    browser = launch(p)
    try:
      page = browser.new_page(viewport={"width": width, "height": 800}, device_scale_factor=1)
      page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
      page.on("pageerror", lambda e: errors.append(str(e)))
      page.route("**/*", route)
      page.goto(url, wait_until="load")
      page.screenshot(path=tmp, full_page=True)
    finally:
      browser.close()
  os.replace(tmp, png_path)
  w, h = png_size(png_path)
  return {"path": png_path, "width": w, "height": h, "console_errors": errors,
          "refused_requests": refused}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m align.evals.screenshot", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("html")
  ap.add_argument("png")
  ap.add_argument("--width", type=int, default=1200)
  args = ap.parse_args(argv)
  try:
    out = screenshot(args.html, args.png, args.width)
  except (RuntimeError, ValueError) as e:
    raise SystemExit(f"screenshot: {e}") from None
  print(f"{out['path']}: {out['width']}x{out['height']}")
  for problem in out["console_errors"] + [f"refused {u}" for u in out["refused_requests"]]:
    print(f"warning: {problem}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
