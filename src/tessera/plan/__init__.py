"""Cost models: device and link profiles, and (later) the plan chooser."""
