"""The CPU inference server's routes: one APIRouter per resource."""
