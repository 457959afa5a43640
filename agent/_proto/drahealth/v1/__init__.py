"""Generated from proto/drahealth/v1/ by scripts/gen_proto.py. Never edited by hand."""
