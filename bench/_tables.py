"""The tables of bench/results/*.md: a pandas DataFrame through `DataFrame.to_markdown`
(tabulate, in the dev extra), in the layout those files have always had: `| a | b |`, then
`|---|---|`, cells unpadded, so that a diff of a results file shows the numbers that changed
rather than a realigned table. Cells are written as given (no number parsing): format them first."""
from __future__ import annotations


def md_table(frame, index: bool = True) -> list[str]:
    """The lines of `frame` as a pipe table: its index first (headed by the index's name) unless
    `index=False`, then its columns."""
    from tabulate import DataRow, TableFormat
    row = DataRow("| ", " | ", " |")
    compact = TableFormat(lineabove=None, linebelowheader=lambda widths, _: "|" + "---|" * len(widths),
                          linebetweenrows=None, linebelow=None, headerrow=row, datarow=row,
                          padding=0, with_header_hide=None)
    return frame.to_markdown(index=index, tablefmt=compact, disable_numparse=True,
                             stralign=None, numalign=None).split("\n")
