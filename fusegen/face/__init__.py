"""The Python face of a generated module, the same whatever backend renders its kernels
(fusegen.face.module): a backend renders only its kernels and places the face around them."""
from .module import Face, Helper, branches, face, module_class_name

__all__ = ["Face", "Helper", "branches", "face", "module_class_name"]
