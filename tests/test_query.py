"""``ridethrough query``: read-only statements only, three output formats."""

from __future__ import annotations

import pytest

from ridethrough.query import QueryRefused, check_read_only, first_keyword, format_csv, format_json, format_table


@pytest.mark.parametrize("sql", ["SELECT 1", "  select 1;", "WITH x AS (SELECT 1) SELECT * FROM x",
                                 "-- comment\nSHOW TABLES", "/* c */ DESCRIBE otel_logs", "EXPLAIN SELECT 1",
                                 "(SELECT 1)", "SELECT ';' AS semicolon"])
def test_read_only_statements_pass(sql: str) -> None:
    check_read_only(sql)


@pytest.mark.parametrize("sql", ["INSERT INTO t VALUES (1)", "DROP TABLE otel_logs", "ALTER TABLE t DELETE WHERE 1",
                                 "SELECT 1; DROP TABLE t", "", "   ", "SYSTEM SHUTDOWN", "OPTIMIZE TABLE t",
                                 "/* SELECT */ TRUNCATE t"])
def test_other_statements_are_refused(sql: str) -> None:
    with pytest.raises(QueryRefused):
        check_read_only(sql)


def test_first_keyword_skips_comments() -> None:
    assert first_keyword("-- x\n/* y */ select 1") == "SELECT"


def test_formats() -> None:
    names, rows = ["a", "m"], [(1, {"k": "v"}), (22, {})]
    table = format_table(names, rows)
    assert table.splitlines()[0].split() == ["a", "m"] and "(2 rows)" in table
    assert format_json(names, rows).startswith("[") and '"k": "v"' in format_json(names, rows)
    assert format_csv(names, rows).splitlines() == ["a,m", '1,"{""k"": ""v""}"', "22,{}"]
