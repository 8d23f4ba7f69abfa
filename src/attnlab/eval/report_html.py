"""report.html: the report's Markdown (report.md) as one self-contained HTML page, its plots embedded."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path


def _md_plain(text: str) -> str:
    """md_text's text back."""
    return re.sub(r"\\([\\|<>&])", r"\1", text)


CELL = re.compile(r"\|((?:[^|\\]|\\.)*)(?=\|)")  # a Markdown table's cells: text up to the next unescaped '|'


def to_html(markdown: str, base: Path) -> str:
    """A self-contained HTML page from the report's Markdown: headings, paragraphs, tables, embedded PNGs."""
    body, table = [], []

    def flush_table():
        if table:
            rows = [[re.sub(r"\\(.)", r"\1", c).strip() for c in CELL.findall(line)] for line in table
                    if not set(line) <= set("|- ")]  # fmt: skip
            head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
            cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        image = re.fullmatch(r"!\[(.*)\]\((.*)\)", line)
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(_md_plain(line.lstrip('# ')))}</h{level}>")
        elif image:
            data = base64.b64encode((base / image.group(2)).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(image.group(1))}" src="data:image/png;base64,{data}">')
        elif line.strip():
            body.append(f"<p>{html.escape(_md_plain(line))}</p>")
    flush_table()
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;"
             "font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%}")  # fmt: skip
    head = f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head>"
    return head + f"<body>{''.join(body)}</body></html>"
