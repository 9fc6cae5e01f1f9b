"""``python3 -m flashgen.families.gluon``: rewrite the code-id records of the Gluon
templates (templates/gluon/attn_fwd.code_id.json, attn_bwd.code_id.json), of the
backward's ragged-batch variants (attn_bwd.varlen_code_id.json) and of the forward's
user variants (attn_fwd.user_code_id.json) after a template edit (:mod:`.code_id`,
:func:`.bwd.varlen_code_id`, :func:`.render.user_code_id`)."""

from . import bwd, render, user_probe
from .bwd import _templates_dir

for name, write, record in (("forward", render.write_code_id, render.CODE_ID_RECORD),
                            ("backward", bwd.write_code_id, bwd.CODE_ID_RECORD)):
    rec = write()
    print(f"wrote {_templates_dir() / record}: {name} code id {rec['code']} (probes {rec['probes']})")
rec = bwd._VARLEN_CODE_ID.record()
print(f"wrote {_templates_dir() / bwd.VARLEN_CODE_ID_RECORD}: ragged-batch backward code id {rec['code']} "
      f"(probes {rec['probes']})")
rec = render.write_user_code_id(user_probe.user_probe_digest())
print(f"wrote {_templates_dir() / render.USER_CODE_ID_RECORD}: user variants' code id {rec['code']} "
      f"(probes {rec['probes']})")
