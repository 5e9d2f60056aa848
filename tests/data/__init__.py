"""Small spec modules the project's own tests import (never run on rank processes)."""
