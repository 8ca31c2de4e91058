"""MoE token dispatchers: allreduce (no dispatch traffic), all_to_all and all_to_all_fixed."""
