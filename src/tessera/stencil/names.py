"""The names the stencil code accepts, in a module with no imports: the command line lists
them as choices without loading numpy or the compiler."""

SHAPES = ("star7", "star13", "star19", "star25", "star31", "star37", "ete37", "ete73")
VELOCITIES = ("constant", "layered", "smooth")
