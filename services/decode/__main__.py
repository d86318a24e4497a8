"""``python -m services.decode``"""

from services.decode.worker import main_entry

if __name__ == "__main__":
    main_entry()
