"""Adapters that plug bumblebee's runtime into outside training frameworks. Each module imports its
framework on import (install it through the extra of the same name: `pip install -e '.[verl]'`)."""
