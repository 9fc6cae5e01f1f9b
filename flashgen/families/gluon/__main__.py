"""``python3 -m flashgen.families.gluon``: rewrite the Gluon backward's code-id record
(templates/gluon/attn_bwd.code_id.json) after a template edit."""

from .bwd import CODE_ID_RECORD, _templates_dir, write_code_id

rec = write_code_id()
print(f"wrote {_templates_dir() / CODE_ID_RECORD}: code id {rec['code']} (probes {rec['probes']})")
