"""Numba kernels of the data layer: ID hashing, delimited-text parsing, jagged layout.

Everything that touches one row or one ID at a time lives here, compiled with
`@njit(cache=True, nogil=True)`, so the readers in Python only move whole arrays around.

ID hashing (`token_key`): a categorical token of 1-8 lowercase hex digits (Criteo's and
Avazu's IDs) is mapped *injectively* together with its field index and its length, then
spread over the whole uint64 space with the bijective splitmix64 finaliser. Equal tokens in
different fields therefore never collide. Any other token is hashed with FNV-1a seeded by
the field and finalised the same way (collisions then have the usual 2**-64 odds).

Quoted fields (RFC 4180): with a quote byte (`quote` >= 0), a field that starts with it runs to
the next lone quote; a doubled quote inside stands for one, and delimiters and newlines inside
are part of the value, so a record (a data row) may span several lines. A quoted value is the
same value as the bare one: `"abc"` hashes as `abc`, `"1.5"` is 1.5. A quote inside an unquoted
field is an ordinary byte. A chunk without a quote byte takes the unquoted path, which is the
parser as it was before quoting existed (one counting pass finds out).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hybridrec.mixing import mix64

# Column kinds understood by `parse_delimited_lines`.
KIND_SKIP = 0
KIND_LABEL = 1
KIND_DENSE = 2
KIND_DENSE_LOG1P = 3
KIND_CATEGORICAL = 4
KIND_MULTI_CATEGORICAL = 5
KIND_HOUR_YYMMDDHH = 6  # Avazu's hour: two sparse slots, hour-of-day then day-of-week

# Why a row was rejected (codes returned by `parse_delimited_lines`).
ERROR_COLUMN_COUNT = 1
ERROR_NOT_A_NUMBER = 2
ERROR_BAD_LABEL = 3
ERROR_BAD_HOUR = 4
ERROR_OUT_OF_RANGE = 5
ERROR_QUOTE = 6
FLOAT32_MAX = float(np.finfo(np.float32).max)
ERROR_REASONS = {
    ERROR_COLUMN_COUNT: "wrong number of columns",
    ERROR_NOT_A_NUMBER: "not a number",
    ERROR_BAD_LABEL: "label is not a number (or not 0/1 where labels are binary)",
    ERROR_BAD_HOUR: "hour is not YYMMDDHH",
    ERROR_OUT_OF_RANGE: f"number out of range (beyond float32's +-{FLOAT32_MAX:.4g}, or infinite)",
    ERROR_QUOTE: "a quoted field is not closed, or text follows its closing quote (RFC 4180: a quote "
                 "inside a quoted field is written twice)",
}
NO_QUOTE = -1  # the `quote` of files read without quoting

# Field indices must fit below the hex value and length bits of the injective key layout.
MAX_FIELDS = 1 << 24

_FNV_PRIME = np.uint64(0x100000001B3)
_FNV_FIELD_SEED = np.uint64(0xCBF29CE484222325)
_NEWLINE = 10
_CARRIAGE_RETURN = 13
# value of each byte as a lowercase hex digit, 255 where it is not one
_HEX_DIGIT = np.full(256, 255, dtype=np.uint8)
_HEX_DIGIT[48:58] = np.arange(10)
_HEX_DIGIT[97:103] = np.arange(10, 16)
# log(1 + x) of the small counts that make up most of Criteo's dense values
_LOG1P_TABLE_SIZE = 4096
_LOG1P_SMALL = np.log1p(np.arange(_LOG1P_TABLE_SIZE, dtype=np.float64))


@njit(cache=True, nogil=True)
def hex_token_key(field, length, value):
    """Key of a token of `length` (1-8) hex digits whose value is `value` in field `field`."""
    packed = ((np.uint64(field) << np.uint64(36)) | (np.uint64(length) << np.uint64(32))
              | np.uint64(value))
    return mix64(packed)


@njit(cache=True, nogil=True)
def token_key(buf, start, end, field):
    """uint64 key of the token buf[start:end] (non-empty) of sparse field `field`."""
    length = end - start
    if length <= 8:
        value = np.uint64(0)
        is_hex = True
        for i in range(start, end):
            digit = _HEX_DIGIT[buf[i]]
            if digit == 255:
                is_hex = False
                break
            value = (value << np.uint64(4)) | np.uint64(digit)
        if is_hex:
            return hex_token_key(field, length, value)
    h = mix64(_FNV_FIELD_SEED ^ np.uint64(field))
    for i in range(start, end):
        h = (h ^ np.uint64(buf[i])) * _FNV_PRIME
    return mix64(h ^ np.uint64(length))


@njit(cache=True, nogil=True)
def hex_token_keys(tokens, fields):
    """Vectorised `hex_token_key` for 8-digit tokens: keys[i] of tokens[i] in fields[i]."""
    keys = np.empty(tokens.shape[0], dtype=np.uint64)
    for i in range(tokens.shape[0]):
        keys[i] = hex_token_key(fields[i], 8, tokens[i])
    return keys


@njit(cache=True, nogil=True)
def hash_string_column(data, offsets, valid, field):
    """Keys of an Arrow-style string column (bytes `data`, `offsets`, validity `valid`).

    Returns (keys, present): null and empty strings are missing IDs (present False)."""
    n = offsets.shape[0] - 1
    keys = np.zeros(n, dtype=np.uint64)
    present = np.zeros(n, dtype=np.bool_)
    for i in range(n):
        start = offsets[i]
        end = offsets[i + 1]
        if valid[i] and end > start:
            keys[i] = token_key(data, start, end, field)
            present[i] = True
    return keys, present


@njit(cache=True, nogil=True)
def _read_sign(buf, i, end):
    """Skips an optional '+' or '-' at buf[i] -> (next index, negative)."""
    if i < end and (buf[i] == 45 or buf[i] == 43):
        return i + 1, buf[i] == 45
    return i, False


@njit(cache=True, nogil=True)
def _read_digits(buf, i, end, accumulated):
    """Appends the decimal digits from buf[i] to `accumulated` -> (next index, value, count)."""
    count = 0
    while i < end and 48 <= buf[i] <= 57:
        accumulated = accumulated * 10.0 + (buf[i] - 48)
        count += 1
        i += 1
    return i, accumulated, count


@njit(cache=True, nogil=True)
def parse_number(buf, start, end):
    """Parses a decimal number ([sign] digits [. digits] [e[sign]digits]) -> (ok, value)."""
    i, negative = _read_sign(buf, start, end)
    i, mantissa, integer_digits = _read_digits(buf, i, end, 0.0)
    fraction_digits = 0
    if i < end and buf[i] == 46:  # '.'
        i, mantissa, fraction_digits = _read_digits(buf, i + 1, end, mantissa)
    if integer_digits + fraction_digits == 0:
        return False, 0.0
    exponent = -fraction_digits
    if i < end and (buf[i] == 101 or buf[i] == 69):  # 'e' or 'E'
        i, exponent_negative = _read_sign(buf, i + 1, end)
        i, written, exponent_digits = _read_digits(buf, i, end, 0.0)
        if exponent_digits == 0:
            return False, 0.0
        written = min(written, 400.0)  # beyond float64's range either way
        exponent += -int(written) if exponent_negative else int(written)
    if i != end:
        return False, 0.0
    value = mantissa
    if exponent < 0:
        value = mantissa / 10.0 ** (-exponent)
    elif exponent > 0:
        value = mantissa * 10.0 ** exponent
    return True, -value if negative else value


@njit(cache=True, nogil=True)
def _log1p_of_count(value):
    """log(1 + max(value, 0)), from a table for small whole numbers."""
    if value <= 0.0:
        return 0.0
    if value < _LOG1P_TABLE_SIZE:
        whole = int(value)
        if whole == value:
            return _LOG1P_SMALL[whole]
    return np.log1p(value)


@njit(cache=True, nogil=True)
def _two_digits(buf, at):
    a = buf[at] - 48
    b = buf[at + 1] - 48
    if a < 0 or a > 9 or b < 0 or b > 9:
        return -1
    return a * 10 + b


@njit(cache=True, nogil=True)
def parse_hour_yymmddhh(buf, start, end):
    """Avazu's hour 'YYMMDDHH' -> (ok, hour_of_day, day_of_week with Monday = 0)."""
    if end - start != 8:
        return False, 0, 0
    year = _two_digits(buf, start)
    month = _two_digits(buf, start + 2)
    day = _two_digits(buf, start + 4)
    hour = _two_digits(buf, start + 6)
    if year < 0 or month < 1 or month > 12 or day < 1 or day > 31 or hour < 0 or hour > 23:
        return False, 0, 0
    # days since 1970-01-01 by the civil-from-days inverse (proleptic Gregorian calendar)
    y = 2000 + year - (1 if month <= 2 else 0)
    era = y // 400
    year_of_era = y - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    days = era * 146097 + day_of_era - 719468
    return True, hour, (days + 3) % 7


@njit(cache=True, nogil=True)
def last_newline(buf, n):
    """Index of the last b'\\n' in buf[:n], or -1."""
    for i in range(n - 1, -1, -1):
        if buf[i] == _NEWLINE:
            return i
    return -1


@njit(cache=True, nogil=True)
def count_newlines(buf, n):
    count = 0
    for i in range(n):
        if buf[i] == _NEWLINE:
            count += 1
    return count


@njit(cache=True, nogil=True)
def count_newlines_and_quotes(buf, n, quote):
    """(newlines, quote bytes) in buf[:n], in one pass; `quote` < 0 counts no quotes."""
    lines = 0
    quotes = 0
    for i in range(n):
        b = buf[i]
        lines += b == _NEWLINE
        quotes += b == quote
    return lines, quotes


@njit(cache=True, nogil=True)
def _quoted_record_end(buf, start, n, delimiter, quote):
    """(index of the newline that ends the record starting at buf[start], newlines inside its
    quoted fields); the index is n when buf[:n] holds no end of that record."""
    inside = False
    field_start = True
    newlines = 0
    i = start
    while i < n:
        b = buf[i]
        if inside:
            if b == quote:
                if i + 1 < n and buf[i + 1] == quote:  # a doubled quote: one quote of the value
                    i += 2
                    continue
                inside = False
            elif b == _NEWLINE:
                newlines += 1
        elif b == _NEWLINE:
            return i, newlines
        elif b == quote and field_start:
            inside = True
            field_start = False
        else:
            field_start = b == delimiter
        i += 1
    return n, newlines


@njit(cache=True, nogil=True)
def scan_records(buf, n, delimiter, quote):
    """(length of the complete records at the start of buf[:n] (each ends in a newline outside
    quotes; 0 when there is none), their newlines, quote bytes in buf[:n]). Without quote bytes
    the records run up to the last newline and their newlines are every newline of buf[:n],
    counted in the same pass that looks for quotes, so the parse need not count them again
    (`parse_delimited_lines`' `newlines`); with quotes the newlines are -1 (not counted)."""
    lines, quotes = count_newlines_and_quotes(buf, n, quote)
    if quotes == 0:
        return last_newline(buf, n) + 1, lines, 0
    done = 0
    while done < n:
        end, _ = _quoted_record_end(buf, done, n, delimiter, quote)
        if end >= n:
            break
        done = end + 1
    return done, -1, quotes


@njit(cache=True, nogil=True)
def complete_records(buf, n, delimiter, quote):
    """Length of the complete records at the start of buf[:n] (see `scan_records`)."""
    return scan_records(buf, n, delimiter, quote)[0]


@njit(cache=True, nogil=True)
def count_records(buf, n, delimiter, quote):
    """Records (data rows, blank lines included) in the complete records buf[:n]."""
    lines, quotes = count_newlines_and_quotes(buf, n, quote)
    if quotes == 0:
        return lines
    records = 0
    done = 0
    while done < n:
        end, _ = _quoted_record_end(buf, done, n, delimiter, quote)
        records += 1
        done = end + 1
    return records


@njit(cache=True, nogil=True)
def _count_fields(buf, start, end, delimiter, quote):
    """Fields of the record buf[start:end]: its delimiters outside quotes, plus one."""
    columns = 1
    inside = False
    field_start = True
    for i in range(start, end):
        b = buf[i]
        if inside:
            if b == quote:
                inside = False  # a doubled quote closes and reopens: the count is the same
                field_start = False
                continue
        elif b == delimiter:
            columns += 1
            field_start = True
            continue
        elif b == quote and field_start:
            inside = True
        field_start = False
    return columns


@njit(cache=True, nogil=True)
def _closing_quote(buf, start, end, quote):
    """(index of the quote closing the field opened at buf[start], whether the value holds a
    doubled quote); the index is -1 when the field does not close before `end`."""
    doubled = False
    i = start + 1
    while i < end:
        if buf[i] == quote:
            if i + 1 < end and buf[i + 1] == quote:
                doubled = True
                i += 2
                continue
            return i, doubled
        i += 1
    return -1, doubled


@njit(cache=True, nogil=True)
def _unescape(buf, start, end, quote):
    """buf[start:end] with each doubled quote written once, in place from `start`; returns the
    value's new length."""
    k = start
    i = start
    while i < end:
        buf[k] = buf[i]
        k += 1
        i += 2 if buf[i] == quote else 1
    return k - start


@njit(cache=True, nogil=True)
def parse_delimited_lines(buf, n, delimiter, separator, quote, kinds, slots, n_labels, n_dense,
                          n_sparse, binary_labels, first_row, block_rows, rank, world_size,
                          row_start, row_stop, newlines, dense_fill):
    """Parses the complete records of buf[:n] (each ending in b'\\n' outside quotes) into
    row-major arrays; `quote` is the quote byte, or `NO_QUOTE` (see the module docstring).
    A quoted value with doubled quotes is rewritten in place (one quote each) where it starts,
    so a caller that needs the text afterwards passes a copy of a buffer holding quotes.

    Record i is data row `first_row + i`; it is parsed only when it lies in [row_start,
    row_stop) and `((first_row + i) // block_rows) % world_size == rank` (rank sharding by
    row blocks); other records are neither kept nor reported as bad.
    Column c is handled by kinds[c] and writes output slot slots[c]. An empty dense value is
    dense_fill[slot] (float64[n_dense], taken as it is: no log1p), empty categoricals are
    missing IDs, blank lines are skipped. A bad row is not kept;
    its record index, column, error code, the byte range of the offending value and the line
    (of buf) it starts on are returned so the caller can report it.

    Returns (labels[r, n_labels], dense[r, n_dense], id_starts[r, n_sparse],
    id_counts[r, n_sparse], ids, row_of_line[r], bad[k, 6] = (record index, column, code,
    value start, value end, line index), records, lines) for r kept rows, k bad rows,
    `records` records and `lines` lines read (more lines than records where quoted fields hold
    newlines). The caller counts buf[:n]'s `newlines` and passes `quote` None when buf[:n] holds
    no quote byte (`scan_records` or `count_newlines_and_quotes` count both in one pass): numba
    then compiles a kernel of its own for None, whose quote branches are pruned before typing, so
    unquoted data parses as fast as before quoting existed.
    """
    capacity = newlines
    n_columns = kinds.shape[0]
    has_multi = False
    for c in range(n_columns):
        if kinds[c] == KIND_MULTI_CATEGORICAL:
            has_multi = True
    id_capacity = capacity * n_sparse
    if has_multi:
        for i in range(n):
            if buf[i] == separator:
                id_capacity += 1
    labels = np.empty((capacity, n_labels), dtype=np.float32)
    dense = np.zeros((capacity, n_dense), dtype=np.float32)
    id_starts = np.zeros((capacity, n_sparse), dtype=np.int64)
    id_counts = np.zeros((capacity, n_sparse), dtype=np.int32)
    ids = np.empty(id_capacity, dtype=np.uint64)
    row_of_line = np.empty(capacity, dtype=np.int64)
    bad = np.empty((capacity, 6), dtype=np.int64)
    kept = 0
    n_bad = 0
    n_ids = 0
    records = capacity
    line = 0
    line_start = 0
    for record in range(capacity):
        if line_start >= n:  # fewer records than newlines: quoted fields hold some
            records = record
            break
        inner_newlines = 0
        if quote is not None:
            line_end, inner_newlines = _quoted_record_end(buf, line_start, n, delimiter, quote)
            if line_end >= n:  # the data ends inside a quoted field: its last newline ends it
                line_end = n - 1
                inner_newlines -= 1
        else:
            line_end = line_start
            while buf[line_end] != _NEWLINE:
                line_end += 1
        next_start = line_end + 1
        if line_end > line_start and buf[line_end - 1] == _CARRIAGE_RETURN:
            line_end -= 1
        row = first_row + record
        mine = row_start <= row < row_stop and (row // block_rows) % world_size == rank
        if not mine or line_end == line_start:
            line_start = next_start
            line += 1 + inner_newlines
            continue
        error = 0
        error_column = 0
        error_start = line_start
        error_end = line_end
        ids_before = n_ids
        pos = line_start
        column = 0
        while error == 0 and column < n_columns:
            if pos > line_end:  # the line ran out of columns
                error = ERROR_COLUMN_COUNT
                break
            start = pos
            if quote is not None and pos < line_end and buf[pos] == quote:
                close, doubled = _closing_quote(buf, pos, line_end, quote)
                start = pos + 1
                end = line_end if close < 0 else close
                pos = end + 1
                if close < 0 or (pos < line_end and buf[pos] != delimiter):  # not closed, or text after it
                    error = ERROR_QUOTE
                    error_column = column
                    error_start = start
                    error_end = pos if close >= 0 else end
                    break
                value_end = end
                if doubled:  # one quote for each doubled one, in place (the caller passed a copy)
                    value_end = start + _unescape(buf, start, end, quote)
            else:
                while pos < line_end and buf[pos] != delimiter:
                    pos += 1
                end = pos
                value_end = end
            pos += 1
            kind = kinds[column]
            slot = slots[column]
            if kind == KIND_LABEL:
                ok, value = parse_number(buf, start, value_end)
                if not ok or (binary_labels and value != 0.0 and value != 1.0):
                    error = ERROR_BAD_LABEL
                elif not abs(value) <= FLOAT32_MAX:
                    error = ERROR_OUT_OF_RANGE
                else:
                    labels[kept, slot] = value
            elif kind == KIND_DENSE or kind == KIND_DENSE_LOG1P:
                value = dense_fill[slot]
                if value_end > start:
                    ok, value = parse_number(buf, start, value_end)
                    if not ok:
                        error = ERROR_NOT_A_NUMBER
                    elif not abs(value) <= FLOAT32_MAX and (kind == KIND_DENSE or abs(value) == np.inf):
                        error = ERROR_OUT_OF_RANGE  # infinite, or stored as float32 inf: it would train as inf
                    if error == 0 and kind == KIND_DENSE_LOG1P:
                        value = _log1p_of_count(value)
                dense[kept, slot] = value
            elif kind == KIND_CATEGORICAL:
                id_starts[kept, slot] = n_ids
                if value_end > start:
                    ids[n_ids] = token_key(buf, start, value_end, slot)
                    n_ids += 1
                    id_counts[kept, slot] = 1
                else:
                    id_counts[kept, slot] = 0
            elif kind == KIND_MULTI_CATEGORICAL:
                id_starts[kept, slot] = n_ids
                piece = start
                for i in range(start, value_end + 1):
                    if i == value_end or buf[i] == separator:
                        if i > piece:
                            ids[n_ids] = token_key(buf, piece, i, slot)
                            n_ids += 1
                        piece = i + 1
                id_counts[kept, slot] = n_ids - id_starts[kept, slot]
            elif kind == KIND_HOUR_YYMMDDHH:
                ok, hour, weekday = parse_hour_yymmddhh(buf, start, value_end)
                if not ok:
                    error = ERROR_BAD_HOUR
                else:
                    id_starts[kept, slot] = n_ids
                    ids[n_ids] = hex_token_key(slot, 8, hour)
                    id_counts[kept, slot] = 1
                    id_starts[kept, slot + 1] = n_ids + 1
                    ids[n_ids + 1] = hex_token_key(slot + 1, 8, weekday)
                    id_counts[kept, slot + 1] = 1
                    n_ids += 2
            if error != 0:
                error_column = column
                error_start = start
                error_end = end
            column += 1
        if error == 0 and pos <= line_end:  # columns left over
            error = ERROR_COLUMN_COUNT
        if error == ERROR_COLUMN_COUNT:
            error_column = _count_fields(buf, line_start, line_end, delimiter,
                                         NO_QUOTE if quote is None else quote)
            error_start = line_start
            error_end = line_end
        if error == 0:
            row_of_line[kept] = row
            kept += 1
        else:
            n_ids = ids_before
            id_counts[kept, :] = 0
            dense[kept, :] = 0.0
            bad[n_bad, 0] = record
            bad[n_bad, 1] = error_column
            bad[n_bad, 2] = error
            bad[n_bad, 3] = error_start
            bad[n_bad, 4] = error_end
            bad[n_bad, 5] = line
            n_bad += 1
        line_start = next_start
        line += 1 + inner_newlines
    return (labels[:kept], dense[:kept], id_starts[:kept], id_counts[:kept], ids[:n_ids],
            row_of_line[:kept], bad[:n_bad], records, line)


@njit(cache=True, nogil=True)
def row_major_to_feature_major(id_starts, id_counts, ids):
    """Reorders per-(row, field) ID runs into the feature-major jagged layout.

    Returns (values, offsets) with the IDs of feature f for row b at
    values[offsets[f*B+b] : offsets[f*B+b+1]]."""
    rows, fields = id_counts.shape
    cursor = np.zeros(fields, dtype=np.int64)  # where feature f's next ID goes
    for b in range(rows):
        for f in range(fields):
            cursor[f] += id_counts[b, f]
    total = 0
    for f in range(fields):
        size = cursor[f]
        cursor[f] = total
        total += size
    offsets = np.empty(fields * rows + 1, dtype=np.int64)
    offsets[fields * rows] = total
    values = np.empty(total, dtype=np.uint64)
    for b in range(rows):  # row-major reads, one sequential write stream per feature
        for f in range(fields):
            out = cursor[f]
            offsets[f * rows + b] = out
            start = id_starts[b, f]
            count = id_counts[b, f]
            for k in range(count):
                values[out + k] = ids[start + k]
            cursor[f] = out + count
    return values, offsets
