"""The README's table of OpenAI request fields is the one the declared schemas give, field for field."""

import re
from pathlib import Path

from jaxserve.openai.field_table import markdown

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_lists_every_declared_field_as_the_schemas_do():
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"<!-- openai-fields:start -->\n(.*?)\n<!-- openai-fields:end -->", readme, re.S).group(1)
    assert listed == markdown(), "README's field table is stale: paste `python -m jaxserve.openai.field_table` in"
