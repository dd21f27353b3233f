"""How a benchmark writes its results: STEM.md and STEM.json side by side.

STEM.md is the markdown a reader opens; STEM.json holds the program's
numbers and, under "tables", the markdown texts that README.md and docs/
render between their table markers (doc_tables.py), so that a doc's table
comes from the same run as the .md next to it.
"""

import json
import os


def write(output_dir, stem, markdown, data):
  """Writes output_dir/STEM.md (`markdown`) and output_dir/STEM.json
  (`data`, a dict that should hold a "tables" dict); returns the paths."""
  if not isinstance(data, dict):
    raise TypeError("%s.json: the results must be a dict (with a 'tables' "
                    "dict), got %s" % (stem, type(data).__name__))
  os.makedirs(output_dir, exist_ok=True)
  md_path = os.path.join(output_dir, stem + ".md")
  json_path = os.path.join(output_dir, stem + ".json")
  with open(md_path, "w") as f:
    f.write(markdown)
  with open(json_path, "w") as f:
    json.dump(data, f, indent=1)
  return md_path, json_path
