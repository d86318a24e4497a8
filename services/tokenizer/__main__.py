"""``python -m services.tokenizer``"""

from services.tokenizer.worker import main_entry

if __name__ == "__main__":
    main_entry()
