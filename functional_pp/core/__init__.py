"""The vocabulary every layer shares: meshes, layouts and rules, the runtime context of a
device, parameter pytrees, seeds, the records of communication and the hooks observers
subscribe to. Nothing here communicates or compiles."""
