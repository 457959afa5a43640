"""Generated from proto/simkubelet/v1/ by scripts/gen_proto.py. Never edited by hand."""
