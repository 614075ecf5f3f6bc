"""Maps logical axis names onto device meshes. Model code never names a mesh axis."""

from parallel.mesh import MESH_AXES, make_mesh, process_mesh, resolve_axis_sizes, to_process_mesh
from parallel.rules import (ACTIVATION_AXES, BATCH_AXES, LOGICAL_AXES, PARAM_AXES,
                            STRATEGIES, Layout, axis_rules, constrain, current_rules, get_layout,
                            get_rules, logical_shardings, logical_to_spec, shards_of)
from parallel.pipeline import (SCHEDULES, PipelineConfig, current_pipeline, measured_bubble,
                               pipeline_from_config, pipeline_schedule, run_layers,
                               schedule_table, theoretical_bubble)
from parallel.expert import (check_experts_divide, expert_axes, expert_parallel_size,
                             shard_map_logical)
from parallel.target import (GPU_TARGETS, PLATFORMS, compile_devices, device_kind, platform,
                             tpu_slice)
