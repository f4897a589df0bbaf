"""Arrow record batches (Parquet, `datasets`) as Python records within the limits, in bounded memory.

Memory follows the batch, never the row group or the file: Parquet is read with `iter_batches`, its
batch size chosen from the row groups' bytes per row so that a batch holds about MAX_RECORD_BYTES, and
each batch goes to Python (`to_pylist`) in slices of at most that many bytes (Arrow's count of the
bytes a slice references). A slice of one row over it is a record over the limit: refused, naming the
row, before Python holds it. A Parquet row group whose bytes exceed MAX_RECORD_BYTES a row on average
must hold such a row: refused from the footer, before its pages are read. Every batch is validated
(offsets, UTF-8) before conversion, since a damaged Arrow file could otherwise be read out of bounds.

Arrow has no "absent": a column or struct field missing from one record reads as null there. Nulls are
dropped, so a record holds the keys its JSON line would (`to_pylist` already makes structs dicts and
lists of structs lists of dicts).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from jobspec.errors import ConfigError
from runner.data import limits
from runner.data.limits import over_limit, size, too_deep

BATCH_ROWS = 1024  # rows per Arrow batch at most: few Python-level calls for short records


def parquet_batches(file: Any, where: str) -> Iterable[Any]:
    """The record batches of a `pyarrow.parquet.ParquetFile`, after the footer's checks."""
    check_schema(file.schema_arrow, where)
    meta, first, widest = file.metadata, 0, 1.0
    for group in range(meta.num_row_groups):
        rows, nbytes = meta.row_group(group).num_rows, meta.row_group(group).total_byte_size
        if rows and nbytes > limits.MAX_RECORD_BYTES * rows:  # by the pigeonhole, one of its rows is over the limit
            span = f"row {first}" if rows == 1 else f"rows {first}-{first + rows - 1}"
            raise ConfigError(
                f"{where}: {span} (row group {group}): "
                + over_limit(f"{size(nbytes)} uncompressed in {rows} row(s), so at least one row is larger")
            )
        widest, first = max(widest, nbytes / max(rows, 1)), first + rows
    return file.iter_batches(batch_size=max(1, min(BATCH_ROWS, int(limits.MAX_RECORD_BYTES // widest))))


def rows(batches: Iterable[Any], where: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row, record) for every row of Arrow record batches or tables, nulls dropped (module docstring)."""
    row, checked = 0, False
    try:
        for batch in batches:
            if not checked:
                check_schema(batch.schema, where)
                checked = True
            batch.validate(full=True)
            for offset, part in _slices(batch, where, row):
                for i, record in enumerate(part.to_pylist()):
                    yield row + offset + i, drop_nulls(record)
            row += batch.num_rows
    except (OSError, ValueError) as err:  # a damaged file found mid-read (ArrowInvalid is a ValueError)
        raise ConfigError(f"{where}: row {row}: cannot read ({err})") from err


def _slices(batch: Any, where: str, first: int) -> Iterator[tuple[int, Any]]:
    """(offset, slice) of `batch` in order, each referencing at most MAX_RECORD_BYTES (converted to Python at
    once: one large record or many small ones); halves until they do."""
    pending = [(0, batch)]
    while pending:
        offset, part = pending.pop()
        nbytes = part.nbytes
        if nbytes <= limits.MAX_RECORD_BYTES:
            yield offset, part
        elif part.num_rows == 1:
            raise ConfigError(f"{where}: row {first + offset}: " + over_limit(f"a record of {size(nbytes)}"))
        else:
            half = part.num_rows // 2
            pending += [(offset + half, part.slice(half)), (offset, part.slice(0, half))]  # the first half pops first


def check_schema(schema: Any, where: str) -> None:
    """ConfigError when a column nests lists or structs more than MAX_DEPTH levels (the row is level 1)."""
    import pyarrow.types  # only called on pyarrow schemas (pyarrow is an optional dependency)

    stack = [(field.type, 2) for field in schema]
    while stack:
        kind, depth = stack.pop()
        kind = getattr(kind, "storage_type", kind)  # an extension type: its storage
        kind = kind.value_type if pyarrow.types.is_dictionary(kind) else kind
        if kind.num_fields:
            if depth > limits.MAX_DEPTH:
                raise ConfigError(f"{where}: the schema {too_deep()}")
            stack.extend((kind.field(i).type, depth + 1) for i in range(kind.num_fields))


def drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value
