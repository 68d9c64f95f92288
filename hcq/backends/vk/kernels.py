"""The Vulkan device's GLSL sources for the kernels the conformance kit names by behaviour (see hcq.conformance)."""

PRELUDE = """#version 460
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(buffer_reference, std430, buffer_reference_align = 4) buffer U32 { uint v[]; };
"""

_ARGS = "layout(push_constant) uniform Push { Args args; };\n"
_ID = "  uint i = gl_GlobalInvocationID.x;\n"

# Reads of the flag are atomic (a loop without side effects may be compiled away), of its two 32-bit halves. lavapipe
# (gallivm) ends every loop of an invocation after 65535 iterations in all, so each iteration reads the flag 256 times:
# the spin then gives up after about 8 s there (writing 2, not 1); on a GPU it spins until the flag is set.
_UNROLLED = "if (up()) break;"
for _ in range(4): _UNROLLED = "{" + _UNROLLED * 4 + "}"
_SPIN = ("bool up() { return (atomicAdd(args.flag.v[0], 0u) | atomicAdd(args.flag.v[1], 0u)) != 0u; }\n"
         "void main() {\n  if (gl_GlobalInvocationID.x != 0) return;\n"
         f"  for (;;) {{ if (up()) break; {_UNROLLED} }}\n"
         "  args.out_.v[0] = up() ? 1u : 2u;\n}\n")

CONFORMANCE_KERNELS: dict[str, tuple[str, str]] = {
    "fill": (PRELUDE + "layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer Args { U32 out_; uint value; uint n; };\n"
             + _ARGS + "void main() {\n" + _ID + "  if (i < args.n) args.out_.v[i] = args.value;\n}\n", "fill"),
    "add": (PRELUDE + "layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer Args { U32 out_; U32 a; U32 b; uint n; };\n"
            + _ARGS + "void main() {\n" + _ID + "  if (i < args.n) args.out_.v[i] = args.a.v[i] + args.b.v[i];\n}\n", "add"),
    "spin": (PRELUDE + "layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer Args { U32 flag; U32 out_; };\n"
             + _ARGS + _SPIN, "spin"),
}
