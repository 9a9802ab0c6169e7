#include <stdio.h>

struct node {
    int value;
    struct node *next;
};

/* Length of a list. */
static int list_length(const struct node *n)
{
    int len = 0;
    while (n) {
        len++;
        n = n->next;
    }
    return len;
}

typedef struct { int w, h; } size_t2;

int main(void)
{
    printf("%d\n", list_length(NULL));
    return 0;
}
