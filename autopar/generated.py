"""Text of generated files (TOML configs, shell scripts) that no name can break out of.

Values go through libraries: TOML strings, arrays and tables through ``tomli_w``, shell
words through ``shlex.quote``. Names also appear in comments, where no quoting exists:
``comment`` escapes every control character, so a name holding a newline cannot start a
TOML table or a shell command on the next line.
"""

from __future__ import annotations

from typing import Any

import tomli_w


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (a string quoted and escaped), for one ``key = value`` line."""
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


def comment(text: str) -> str:
    """``text`` made safe for one comment line: control characters escaped as ``\\n`` etc."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in str(text))
