"""Pure maths shared by every layer above: attend, masks from positions, RoPE, norms, MLPs, head reshapes.

Nothing here holds state between calls or imports anything of attnlab's above `errors`."""
