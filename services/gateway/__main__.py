"""``python -m services.gateway``"""

from services.gateway.server import main_entry

if __name__ == "__main__":
    main_entry()
