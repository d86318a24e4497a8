"""``python -m services.gateway``"""

from services.gateway.worker import main_entry

if __name__ == "__main__":
    main_entry()
